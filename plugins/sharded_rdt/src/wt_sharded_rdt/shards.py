"""Slices of sharded parameters, cut into the pieces the owners' local shards hold.

With `local_shards` the trainer never gathers: each rank publishes its local
piece of a parameter (`iter_local`), which lies at `local_box` of the full
tensor. A consumer's slice (`Scatter.key`: an op chain on the full tensor) is
cut into its intersections with those boxes (`shard_pieces`); each piece is
pulled from an owner that holds it, as a chain on that owner's local tensor
(narrow, permute, reshape), and lands in the matching part of the slice's
destination. So each consumer moves exactly its slices, each owner serves
only its own bytes, and nobody holds a full tensor.

A slice can be cut when it is a box of the full tensor (`slice_box`): what
narrowing, indexing, chunking, splitting, transposing and permuting dims, and
adding or dropping dims of size one make of it, as every dense vLLM loader
does. Any other slice is refused when the consumer plans, naming the
parameter and its chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.backend import ParamMeta, Replicate, Shard
from wt_kits.slices import (
    Box,
    Chain,
    Op,
    Scatter,
    apply_chain,
    describe_chain,
    shard_boxes,
    storage_id,
    unravel,
)

__all__ = [
    "SliceBox",
    "slice_box",
    "shard_pieces",
    "encode_layout",
    "decode_layout",
    "check_owner_ranks",
]


@dataclass(frozen=True)
class SliceBox:
    """A slice that is a box of the full tensor: the box (per full dim `(start,
    length)`) and, per slice dim, the full dim it runs along (None: size one)."""

    box: Box
    dims: tuple[int | None, ...]


def slice_box(meta: ParamMeta, chain: Chain) -> SliceBox | None:
    """The box `chain` cuts from `meta`'s full tensor, or None when it cuts no box.

    The chain is replayed on a meta tensor (`contiguous` left out: it moves no
    value); the result must be a view of it with `meta`'s dtype, each of whose
    dims longer than one steps along a distinct full dim by one element.
    """
    base = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    try:
        view = apply_chain(base, tuple(op for op in chain if op[0] != "contiguous"))
    except Exception:
        return None
    if view.dtype != meta.dtype or storage_id(view) != storage_id(base):
        return None
    strides = base.stride()
    start = unravel(int(view.storage_offset()), meta.shape)
    length = [1] * len(meta.shape)
    dims: list[int | None] = []
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1:
            dims.append(None)
            continue
        d = next((d for d, n in enumerate(meta.shape) if n > 1 and strides[d] == stride), None)
        if d is None or d in dims or start[d] + size > meta.shape[d]:
            return None
        length[d] = size
        dims.append(d)
    return SliceBox(tuple(zip(start, length, strict=True)), tuple(dims))


def shard_pieces(meta: ParamMeta, scatter: Scatter) -> list[tuple[list[int], Scatter]]:
    """`scatter`'s slice of sharded parameter `meta`, cut into the pieces its owners'
    local shards hold: per non-empty piece, the owners holding it and the scatter
    that pulls it (its key a chain on an owner's local tensor) and lands it.
    `ValueError` names the parameter when the slice is not a box."""
    chain = scatter.key[1]
    cut = slice_box(meta, chain)
    dest = _dest_strides(scatter)
    if cut is None or dest is None:
        raise ValueError(
            f"parameter {meta.name!r}: this worker loads {describe_chain(chain)} of it, which is "
            "not a box of the tensor, so it cannot be cut from the trainer's local shards "
            "(send full tensors: local_shards=False)"
        )
    pieces = []
    for local, owners in shard_boxes(meta):
        inter = [
            (max(s, lo), min(s + n, lo + m) - max(s, lo))
            for (s, n), (lo, m) in zip(cut.box, local, strict=True)
        ]
        if any(n <= 0 for _, n in inter):
            continue
        ops: list[Op] = [
            ("narrow", (d, s - lo, n), ())
            for d, ((s, n), (lo, m)) in enumerate(zip(inter, local, strict=True))
            if (s - lo, n) != (0, m)
        ]
        order = [d for d in cut.dims if d is not None]
        perm = (*order, *(d for d in range(len(inter)) if d not in order))
        if perm != tuple(range(len(inter))):
            ops.append(("permute", (perm,), ()))
        shape = tuple(1 if d is None else inter[d][1] for d in cut.dims)
        ops.append(("reshape", (shape,), ()))
        offset = scatter.offset + sum(
            (inter[d][0] - cut.box[d][0]) * stride
            for d, stride in zip(cut.dims, dest, strict=True)
            if d is not None
        )
        piece = Scatter(
            key=(meta.name, tuple(ops)),
            module=scatter.module,
            param=scatter.param,
            offset=offset,
            shape=shape,
            stride=dest,
            src_shape=shape,
            src_dtype=scatter.src_dtype,
        )
        pieces.append((owners, piece))
    return pieces


def _dest_strides(scatter: Scatter) -> tuple[int, ...] | None:
    """The destination's stride along each slice dim (the copy lines up the dims
    longer than one; a dim of size one gets stride 0)."""
    longer = iter([(n, s) for n, s in zip(scatter.shape, scatter.stride, strict=True) if n != 1])
    strides = []
    for n in scatter.src_shape:
        if n == 1:
            strides.append(0)
            continue
        got = next(longer, None)
        if got is None or got[0] != n:
            return None
        strides.append(got[1])
    return tuple(strides) if next(longer, None) is None else None


def encode_layout(meta: ParamMeta) -> list[list[int]]:
    """`[owners, mesh_shape, placements]` of a sharded parameter, JSON-safe: a
    placement is the dim a `Shard` splits, -1 for `Replicate`."""
    assert meta.owners is not None and meta.mesh_shape is not None and meta.placements
    return [
        list(meta.owners),
        list(meta.mesh_shape),
        [p.dim if isinstance(p, Shard) else -1 for p in meta.placements],
    ]


def decode_layout(meta: ParamMeta, layout: Any, *, field: str, ranks: int) -> ParamMeta:
    """`meta` with the layout `encode_layout` wrote, of a trainer of `ranks` ranks;
    `ValueError` names `field`, then the parameter and its field that does not fit
    (`ParamMeta`, `check_owner_ranks`; a placement is a dim or -1)."""
    try:
        owners, mesh_shape, placements = layout
        codes = [int(p) for p in placements]
        if any(p < -1 for p in codes):
            raise ValueError(
                f"parameter {meta.name!r}: field 'placements' holds {min(codes)}, neither a "
                "tensor dim nor -1 (Replicate)"
            )
        decoded = ParamMeta(
            meta.name,
            meta.dtype,
            meta.shape,
            owners=tuple(int(r) for r in owners),
            mesh_shape=tuple(int(n) for n in mesh_shape),
            placements=tuple(Replicate() if p == -1 else Shard(p) for p in codes),
        )
        check_owner_ranks(decoded, ranks)
    except (TypeError, ValueError) as error:
        raise ValueError(f"init_info: field {field!r}: {error}") from None
    return decoded


def check_owner_ranks(meta: ParamMeta, ranks: int) -> None:
    """`ValueError` naming the parameter and its field 'owners' when an owner it
    declares is not a rank of a trainer of `ranks` ranks (`0..ranks - 1`); the
    other fields of a layout are checked where `ParamMeta` is made."""
    beyond = [r for r in meta.owners or () if r >= ranks]
    if beyond:
        raise ValueError(
            f"parameter {meta.name!r}: field 'owners' names trainer rank {beyond[0]}, but the "
            f"trainer has {ranks} rank{'s' if ranks != 1 else ''} (0..{ranks - 1})"
        )
