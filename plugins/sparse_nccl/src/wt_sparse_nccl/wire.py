"""What `sparse_nccl` puts on the control plane and on the wire.

Init: the workers get `SparseNCCLInitInfo` (core's `GroupInitInfo`): the
trainer is rank 0 of a private group, workers follow from `rank_offset`.

Per batch, `SparseNCCLUpdateInfo` lists, for each patch in order, its name,
values dtype, index dtype, full shape and entry count. The data follows as one
broadcast per *wire group* (`wire_groups`): first the indices of all patches,
one group per index dtype in order of first appearance, then the values, one
group per values dtype likewise. Within a group, patches keep list order and
their elements are concatenated; a group travels as its raw bytes, so any
allowed dtype crosses bit-exactly. A group without elements is not sent. Both
sides derive the groups from the update info alone, so a batch costs a handful
of broadcasts and O(nnz) bytes whatever the number of patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from weight_transfer.backend import (
    GroupInitInfo,
    WeightTransferUpdateInfo,
    as_bytes,
    dtype_from_name,
    dtype_name,
)
from wt_sparse_nccl.patch import INDEX_DTYPES, SparseWeightPatch

__all__ = [
    "SparseNCCLInitInfo",
    "SparseNCCLUpdateInfo",
    "WireGroup",
    "wire_groups",
    "update_info_of",
    "pack_group",
    "unpack_group",
]


@dataclass
class SparseNCCLInitInfo(GroupInitInfo):
    """Worker init info: where the trainer's group is, its size and its timeout."""


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
        for field in ("dtype_names", "index_dtype_names", "shapes", "num_updates"):
            got = len(getattr(self, field))
            if got != n:
                raise ValueError(f"update_info: field {field!r} has {got} entries, 'names' has {n}")
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
    """One broadcast: the `kind` tensors of patches `members` (with `counts` elements each)."""

    kind: Literal["indices", "values"]
    dtype: torch.dtype
    members: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.counts)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def wire_groups(info: SparseNCCLUpdateInfo) -> list[WireGroup]:
    """The batch's broadcasts, in wire order (see module doc)."""
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
                groups.append(WireGroup(kind, dtype, members, counts))
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
    """The bytes of `group`, on `device`, ready to broadcast."""
    parts = [getattr(patches[i], group.kind).detach().to(device) for i in group.members]
    return as_bytes(torch.cat(parts))


def unpack_group(group: WireGroup, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Views of received `buffer` (uint8), one 1-D tensor per member of `group`."""
    return list(buffer.view(group.dtype).split(list(group.counts)))
