"""What `sparse_nccl` puts on the control plane and on the wire.

Init: the workers get `SparseNCCLInitInfo` (core's `GroupInitInfo`): the
trainer is rank 0 of a private group, workers follow from `rank_offset`;
`verify` (off by default) adds a digest of every patch's bytes.

Per batch, `SparseNCCLUpdateInfo` lists, for each patch in order, its name,
values dtype, index dtype, full shape and entry count. The data is grouped
into *wire groups* (`wire_groups`): first the indices of all patches, one
group per index dtype in order of first appearance, then the values, one
group per values dtype likewise. Within a group, patches keep list order;
a group travels as raw bytes, so any allowed dtype crosses bit-exactly. A
group without elements is not sent. Without `verify` a group is its members'
elements back to back; with it each member starts on an `ALIGNMENT` boundary
(core's `aligned_layout`), where core's `BucketDigests` can digest it.

On the wire, per batch:

1. the header (`BatchHeader`, `int64[HEADER_WORDS]`, the same size whatever
   the batch): a digest of each declared field of the trainer's update info
   (`DECLARED_FIELDS`), the number of wire groups, and each group's bytes and
   members;
2. per wire group, its bytes, then with `verify` its digests
   (`int64[members, 2]`, `BucketDigests` over `digest_plan`).

A worker sizes every receive from the header, never from the update info it
was handed, so an update info that differs from what the trainer sends
cannot make gloo abort the worker ("Received data size doesn't match"): the
worker receives the trainer's bytes whole, then refuses the batch naming the
field that differs (`declared_mismatch`), and the group stays in step. A
batch costs a handful of broadcasts and O(nnz) bytes whatever the number of
patches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from weight_transfer.backend import (
    WIRE_DTYPES,
    ParamMeta,
    WeightTransferUpdateInfo,
    dtype_from_name,
    dtype_name,
)
from wt_kits.group import GroupInitInfo
from wt_kits.stream import Bucket, BucketPlan, Piece, aligned_layout, as_bytes
from wt_sparse_nccl.patch import INDEX_DTYPES, SparseWeightPatch

__all__ = [
    "SparseNCCLInitInfo",
    "SparseNCCLUpdateInfo",
    "WireGroup",
    "wire_groups",
    "update_info_of",
    "pack_group",
    "unpack_group",
    "DECLARED_FIELDS",
    "declared_digests",
    "BatchHeader",
    "HEADER_WORDS",
    "MAX_WIRE_GROUPS",
    "declared_mismatch",
    "digest_plan",
]

# The update info's fields that decide what crosses the wire, in header order.
DECLARED_FIELDS = ("names", "dtype_names", "index_dtype_names", "shapes", "num_updates")
# At most one group per index dtype and one per values dtype.
MAX_WIRE_GROUPS = len(INDEX_DTYPES) + len(WIRE_DTYPES)
HEADER_WORDS = len(DECLARED_FIELDS) + 1 + 2 * MAX_WIRE_GROUPS


@dataclass
class SparseNCCLInitInfo(GroupInitInfo):
    """Worker init info: where the trainer's group is, its size, its timeout,
    whether every batch carries digests of its bytes (`verify`), and whether
    floating-point values are cast to their target's dtype (`cast_values`)."""

    verify: bool = field(default=False, kw_only=True)
    cast_values: bool = field(default=False, kw_only=True)


@dataclass
class SparseNCCLUpdateInfo(WeightTransferUpdateInfo):
    """One batch of patches, one entry per patch in each list (see module doc)."""

    names: list[str]
    dtype_names: list[str]
    index_dtype_names: list[str]
    shapes: list[list[int]]
    num_updates: list[int]
    trainer_id: str = ""  # the trainer the batch comes from

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise ValueError("update_info: field 'names' must list at least one patch")
        for field_name in ("dtype_names", "index_dtype_names", "shapes", "num_updates"):
            got = len(getattr(self, field_name))
            if got != n:
                raise ValueError(
                    f"update_info: field {field_name!r} has {got} entries, 'names' has {n}"
                )
        for i, name in enumerate(self.names):
            if not name:
                raise ValueError(f"update_info: field 'names[{i}]' must not be empty")
        for i, count in enumerate(self.num_updates):
            if count < 0:
                raise ValueError(
                    f"update_info: field 'num_updates[{i}]' must be non-negative, got {count}"
                )
        for i, shape in enumerate(self.shapes):
            if any(d < 0 for d in shape):
                raise ValueError(
                    f"update_info: field 'shapes[{i}]' has a negative dimension: {shape}"
                )
        try:
            self.values_dtypes = [
                dtype_from_name(d, field=f"dtype_names[{i}]")
                for i, d in enumerate(self.dtype_names)
            ]
            self.index_dtypes = [
                dtype_from_name(d, field=f"index_dtype_names[{i}]")
                for i, d in enumerate(self.index_dtype_names)
            ]
        except ValueError as e:
            raise ValueError(f"update_info: {e}") from None
        for i, dtype in enumerate(self.index_dtypes):
            if dtype not in INDEX_DTYPES:
                raise ValueError(
                    f"update_info: field 'index_dtype_names[{i}]' must be int32 or int64, "
                    f"got {self.index_dtype_names[i]!r}"
                )


@dataclass(frozen=True)
class WireGroup:
    """One broadcast: the `kind` tensors of patches `members` (with `counts` elements
    each), member `j` at byte `offsets[j]` of the group's `nbytes`."""

    kind: Literal["indices", "values"]
    dtype: torch.dtype
    members: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return sum(self.counts)


def _layout(counts: Sequence[int], itemsize: int, aligned: bool) -> tuple[list[int], int]:
    """Member offsets and the group's bytes: back to back, or `ALIGNMENT`-aligned."""
    sizes = [count * itemsize for count in counts]
    if aligned:
        return aligned_layout(sizes)
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


def wire_groups(info: SparseNCCLUpdateInfo, *, aligned: bool = False) -> list[WireGroup]:
    """The batch's wire groups, in wire order (see module doc); `aligned` under `verify`."""
    groups: list[WireGroup] = []
    kinds: tuple[tuple[Literal["indices", "values"], list[torch.dtype]], ...] = (
        ("indices", info.index_dtypes),
        ("values", info.values_dtypes),
    )
    for kind, dtypes in kinds:
        for dtype in dict.fromkeys(dtypes):
            members = tuple(i for i, d in enumerate(dtypes) if d == dtype)
            counts = tuple(info.num_updates[i] for i in members)
            if sum(counts) > 0:
                offsets, nbytes = _layout(counts, dtype.itemsize, aligned)
                groups.append(WireGroup(kind, dtype, members, counts, tuple(offsets), nbytes))
    return groups


def update_info_of(patches: Sequence[SparseWeightPatch]) -> SparseNCCLUpdateInfo:
    """The update info describing checked `patches`."""
    return SparseNCCLUpdateInfo(
        names=[p.name for p in patches],
        dtype_names=[dtype_name(p.values.dtype) for p in patches],
        index_dtype_names=[dtype_name(p.indices.dtype) for p in patches],
        shapes=[[int(d) for d in p.full_shape] for p in patches],
        num_updates=[p.nnz for p in patches],
    )


def pack_group(
    group: WireGroup, patches: Sequence[SparseWeightPatch], device: torch.device
) -> torch.Tensor:
    """The bytes of `group`, on `device`, ready to broadcast (padding is zero)."""
    out = torch.zeros(group.nbytes, dtype=torch.uint8, device=device)
    for i, offset in zip(group.members, group.offsets, strict=True):
        data = as_bytes(getattr(patches[i], group.kind).detach().contiguous())
        out[offset : offset + data.numel()].copy_(data)
    return out


def unpack_group(group: WireGroup, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of received `buffer` (uint8), one 1-D tensor per member of `group`."""
    size = group.dtype.itemsize
    return [
        buffer[offset : offset + count * size].view(group.dtype)
        for count, offset in zip(group.counts, group.offsets, strict=True)
    ]


def declared_digests(info: SparseNCCLUpdateInfo) -> tuple[int, ...]:
    """One signed 64-bit digest of each of `DECLARED_FIELDS` (its compact JSON)."""
    digests = []
    for name in DECLARED_FIELDS:
        text = json.dumps(getattr(info, name), separators=(",", ":")).encode()
        raw = hashlib.blake2b(text, digest_size=8).digest()
        digests.append(int.from_bytes(raw, "little", signed=True))
    return tuple(digests)


@dataclass(frozen=True)
class BatchHeader:
    """What the trainer broadcasts before a batch (module doc): `fields`, the digests
    of its update info (`declared_digests`); `groups`, per wire group `(nbytes, members)`."""

    fields: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, info: SparseNCCLUpdateInfo, groups: Sequence[WireGroup]) -> BatchHeader:
        return cls(declared_digests(info), tuple((g.nbytes, len(g.members)) for g in groups))

    def tensor(self, device: torch.device) -> torch.Tensor:
        """`int64[HEADER_WORDS]`: fields, group count, then `(nbytes, members)` per group."""
        words = [*self.fields, len(self.groups)]
        for nbytes, members in self.groups:
            words += [nbytes, members]
        words += [0] * (HEADER_WORDS - len(words))
        return torch.tensor(words, dtype=torch.int64, device=device)

    @classmethod
    def parse(cls, header: torch.Tensor) -> BatchHeader:
        """The header in `header`; `ValueError` if it cannot be one (a broken wire)."""
        words = [int(w) for w in header.tolist()]
        n_fields = len(DECLARED_FIELDS)
        count = words[n_fields]
        if not 0 <= count <= MAX_WIRE_GROUPS:
            raise ValueError(
                f"sparse_nccl: the batch header announces {count} wire groups "
                f"(at most {MAX_WIRE_GROUPS}); the wire is out of step"
            )
        base = n_fields + 1
        groups = tuple((words[base + 2 * k], words[base + 2 * k + 1]) for k in range(count))
        for k, (nbytes, members) in enumerate(groups):
            if nbytes <= 0 or members <= 0:
                raise ValueError(
                    f"sparse_nccl: the batch header announces wire group {k} with {nbytes} "
                    f"bytes and {members} members; the wire is out of step"
                )
        return cls(tuple(words[:n_fields]), groups)

    @property
    def nbytes(self) -> int:
        """The bytes of the batch's wire groups."""
        return sum(nbytes for nbytes, _ in self.groups)


def declared_mismatch(
    info: SparseNCCLUpdateInfo, groups: Sequence[WireGroup], sent: BatchHeader
) -> str | None:
    """Why `info` (with its wire `groups`) does not describe the batch `sent`, or None.

    Names the first field of `DECLARED_FIELDS` whose digest differs from the
    trainer's; failing that, the first wire group of a different size (a
    layout the two sides derive differently).
    """
    mine_all = declared_digests(info)
    for name, mine, theirs in zip(DECLARED_FIELDS, mine_all, sent.fields, strict=True):
        if mine != theirs:
            return (
                f"update_info: field {name!r} differs from the batch the trainer sent (its "
                f"digest {mine} != the trainer's {theirs})"
            )
    derived = BatchHeader.of(info, groups).groups
    if derived != sent.groups:
        for k in range(max(len(derived), len(sent.groups))):
            mine_g = derived[k] if k < len(derived) else None
            theirs_g = sent.groups[k] if k < len(sent.groups) else None
            if mine_g != theirs_g:
                return (
                    f"update_info: wire group {k} is {mine_g} (bytes, members) here, "
                    f"{theirs_g} at the trainer"
                )
    return None


def digest_plan(info: SparseNCCLUpdateInfo, groups: Sequence[WireGroup]) -> BucketPlan:
    """The `BucketPlan` that `BucketDigests` digests a batch by: bucket `k` is wire
    group `k` (laid out `aligned`), one piece per member, named `"<kind> of patch <i>
    (<name>)"` so a mismatch names the patch."""
    params: list[ParamMeta] = []
    buckets: list[Bucket] = []
    last_bucket: list[int] = []
    for k, group in enumerate(groups):
        pieces = []
        for i, count, offset in zip(group.members, group.counts, group.offsets, strict=True):
            pieces.append(Piece(len(params), 0, count * group.dtype.itemsize, offset))
            label = f"{group.kind} of patch {i} ({info.names[i]!r})"
            params.append(ParamMeta(label, group.dtype, (count,)))
            last_bucket.append(k)
        buckets.append(Bucket(tuple(pieces), group.nbytes))
    return BucketPlan(tuple(params), tuple(buckets), tuple(last_bucket))
