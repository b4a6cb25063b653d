"""Sources as engines see them: `source_view` (either way of writing one, wt's
contract), where each rank's piece of a sharded parameter lies (`local_box`,
`shard_boxes`), `ModuleSource` (a module's parameters, plain or DTensor), and
the tensors of one round handed over on the call (`StreamedSource`, with
`param_metadata` for metadata written as `(name, dtype, shape)` triplets)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import torch

from weight_transfer.payload import dtype_from_name
from weight_transfer.source import (
    ParamMeta,
    Placement,
    Replicate,
    Shard,
    WeightSource,
    materialize_full_tensor,
    metadata_of,
    overrides,
)

__all__ = [
    "source_view",
    "ModuleSource",
    "StreamedSource",
    "param_metadata",
    "Box",
    "local_box",
    "shard_boxes",
    "unravel",
]

# `(name, dtype, shape)`: a parameter as TRL's and vLLM's clients describe one.
Triplet = tuple[str, "str | torch.dtype", Sequence[int]]

# A box of a tensor: per dim, `(start, length)`.
Box = tuple[tuple[int, int], ...]


def local_box(meta: ParamMeta, rank: int) -> Box:
    """Where `rank`'s piece (what `iter_local` yields on it) lies in `meta`'s full
    tensor: each `Shard(d)` mesh axis, outer first, splits dim `d` of what the
    outer axes left as `torch.chunk` does (a rank past the last chunk holds an
    empty piece). The whole tensor for a replicated parameter; `ValueError`
    names the parameter when `rank` is not an owner."""
    box = [(0, n) for n in meta.shape]
    if meta.owners is None or meta.placements is None:
        return tuple(box)
    if rank not in meta.owners:
        raise ValueError(f"parameter {meta.name!r}: rank {rank} is not one of its owners")
    assert meta.mesh_shape is not None
    coords = unravel(meta.owners.index(rank), meta.mesh_shape)
    for placement, coord, ways in zip(meta.placements, coords, meta.mesh_shape, strict=True):
        if isinstance(placement, Shard):
            start, length = box[placement.dim]
            step = -(-length // ways)  # torch.chunk's chunk size
            lo = min(coord * step, length)
            box[placement.dim] = (start + lo, min(step, length - lo))
    return tuple(box)


def shard_boxes(meta: ParamMeta) -> list[tuple[Box, list[int]]]:
    """Each distinct piece of a sharded parameter with the owners that hold it (a
    replicated mesh axis gives a piece several), in first-owner order."""
    assert meta.owners is not None
    found: dict[Box, list[int]] = {}
    for rank in meta.owners:
        found.setdefault(local_box(meta, rank), []).append(rank)
    return list(found.items())


def unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    """The row-major coordinates of flat `index` in `shape` (0 along an empty dim)."""
    coords = []
    for n in reversed(shape):
        coords.append(index % n if n else 0)
        index = index // n if n else 0
    return coords[::-1]


def source_view(source: Any, rank: int | None = None) -> Any:
    """`source` as wt's contract (the module doc): itself when written
    wt's way; a source written as vLLM 0.33 writes one (its `metadata` is a list,
    or it iterates through `iter_full` and defines no `__iter__`) is seen through
    a view whose `metadata()` is its metadata, whose `held_names()` are its
    `owned_names(rank)` and whose iteration is its `iter_full()` with `None` for
    the names other ranks own. `rank` defaults to this process's rank in the
    default process group (0 without one), as vLLM 0.33's sources assume."""
    if source is None:
        return None
    spec_style = callable(getattr(source, "metadata", None)) and (
        overrides(source, "__iter__") or not overrides(source, "iter_full")
    )
    return source if spec_style else _ViewOf033(source, rank)


class _ViewOf033(WeightSource):
    """A source written as vLLM 0.33 writes one, seen wt's way (`source_view`)."""

    def __init__(self, source: Any, rank: int | None) -> None:
        self.source = source
        self._rank = rank

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def metadata(self) -> list[ParamMeta]:
        return metadata_of(self.source)

    def held_names(self) -> Collection[str] | None:
        metas = self.metadata()
        if all(m.owners is None for m in metas):
            return None
        return set(self.source.owned_names(self.rank))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if not self.implements_iter_full():
            raise TypeError(
                f"{type(self.source).__name__} implements no iter_full(): this backend "
                "sends full tensors (implement iter_full, or use a backend that consumes "
                "iter_local)"
            )
        held = self.held_names()
        pairs = iter(self.source.iter_full())
        for meta in self.metadata():
            if held is not None and meta.name not in held:
                yield meta.name, None
                continue
            pair = next(pairs, None)
            if pair is None:
                return  # `checked_iteration` names the parameter that is missing
            yield pair
        yield from pairs  # ... and one that follows them all

    def owned_names(self, rank: int) -> list[str]:
        return list(self.source.owned_names(rank))

    def implements_iter_full(self) -> bool:
        return bool(self.source.implements_iter_full())

    def implements_iter_local(self) -> bool:
        return bool(self.source.implements_iter_local())

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.source.iter_full())

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.source.iter_local())


class ModuleSource(WeightSource):
    """A module's `named_parameters()`, plain or sharded (DTensor / FSDP2), declared
    as vLLM 0.33 declares them.

    A plain tensor is every rank's. A DTensor is owned by the global ranks of its
    device mesh, with the mesh's shape and its placements (a layout other than
    plain `Shard` / `Replicate`, such as FSDP+TP's strided shards, is declared
    replicated). `metadata()` reads global shapes and never gathers. Iteration
    (and `iter_full`) gathers each DTensor with `full_tensor()`, a collective
    among its owners, so every rank must iterate; a parameter this rank does
    not own yields None (`iter_full` skips it). `iter_local` yields each owned
    parameter's `to_local()` (gathered where its layout is not plain). Mesh
    ranks are taken as trainer ranks: the default process group's ranks must
    be the `TrainerInitInfo.rank`s.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, p.dtype, tuple(p.shape), **_layout(p))
            for name, p in self.module.named_parameters()
        ]

    def held_names(self) -> Collection[str] | None:
        params = list(self.module.named_parameters())
        if all(_is_member(p) for _, p in params):
            return None
        return {name for name, p in params if _is_member(p)}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, p in self.module.named_parameters():
            yield name, materialize_full_tensor(p.detach()) if _is_member(p) else None

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.module.named_parameters():
            if not _is_member(p):
                continue
            layout = _layout(p)
            if not layout or layout["placements"] is None:
                yield name, materialize_full_tensor(p.detach())
            else:
                yield name, p.detach().to_local()  # type: ignore[attr-defined]


def _layout(param: torch.Tensor) -> dict[str, Any]:
    """`owners`, `mesh_shape` and `placements` of a DTensor (nothing for a plain tensor);
    placements None when the layout is not plain `Shard` / `Replicate`."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return {}
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    grid = mesh.mesh
    placements: list[Placement] | None = []
    for p in param.placements:  # type: ignore[attr-defined]
        if type(p) is TorchShard:
            placements.append(Shard(p.dim))  # type: ignore[union-attr]
        elif type(p) is TorchReplicate:
            placements.append(Replicate())  # type: ignore[union-attr]
        else:
            placements = None
            break
    return {
        "owners": tuple(int(r) for r in grid.flatten().tolist()),
        "mesh_shape": tuple(grid.shape),
        "placements": None if placements is None else tuple(placements),
    }


def _is_member(param: torch.Tensor) -> bool:
    """Whether this rank is in `param`'s device mesh (a plain tensor: always)."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is None or mesh.get_coordinate() is not None


def param_metadata(triplets: Iterable[Triplet | ParamMeta]) -> list[ParamMeta]:
    """`ParamMeta`s of `(name, dtype, shape)` triplets as TRL and vLLM write them:
    `dtype` a `torch.dtype` or its name, with or without `torch.` (`"bfloat16"`,
    `"torch.float32"`), `shape` a sequence of ints (a `ParamMeta` passes as it
    is). `ValueError` names the entry and the field."""
    metas = []
    for i, entry in enumerate(triplets):
        if isinstance(entry, ParamMeta):
            metas.append(entry)
            continue
        try:
            name, dtype, shape = entry
        except (TypeError, ValueError):
            raise ValueError(f"metadata[{i}]: not a (name, dtype, shape): {entry!r}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"metadata[{i}]: field 'name' must be a non-empty string: {name!r}")
        if not isinstance(dtype, torch.dtype):
            field = f"metadata[{i}] ({name!r}): dtype"
            dtype = dtype_from_name(str(dtype).removeprefix("torch."), field=field)
        if not isinstance(shape, Sequence) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"metadata[{i}] ({name!r}): field 'shape' must be sizes: {shape!r}")
        metas.append(ParamMeta(name, dtype, tuple(shape)))
    return metas


class StreamedSource(WeightSource):
    """The tensors of one round, handed over on the call: `metadata` (`ParamMeta`s,
    or `(name, dtype, shape)` triplets: `param_metadata`) and `pairs`, an iterable
    of `(name, tensor)` in the same order, iterated once. For
    `send_weights(source=...)` and `send_weight_chunk`, where a framework hands
    a round's tensors over as it makes them; each is checked against its entry
    as it is drawn, as any source's are."""

    def __init__(
        self,
        metadata: Iterable[Triplet | ParamMeta],
        pairs: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        self._metas = param_metadata(metadata)
        self._pairs: Iterator[tuple[str, torch.Tensor]] | None = iter(pairs)

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pairs, self._pairs = self._pairs, None
        if pairs is None:
            raise RuntimeError("a StreamedSource is iterated once: make one per round or chunk")
        return pairs
