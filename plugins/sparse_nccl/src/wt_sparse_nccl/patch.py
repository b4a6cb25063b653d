"""`SparseWeightPatch` and the checks both sides run on patches.

A patch sets `values[k]` at flat position `indices[k]` of parameter `name`
(HF / checkpoint name) whose full, unsharded shape is `full_shape`. Indices
are 1-D int32 or int64, unique within a patch and in `[0, numel)`; values are
1-D, as long as the indices, of a dtype the wire allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.backend import dtype_name

__all__ = [
    "INDEX_DTYPES",
    "SparseWeightPatch",
    "check_indices",
    "check_indices_of",
    "check_patches",
    "check_dtype",
]

INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


@dataclass
class SparseWeightPatch:
    """New `values` at flat `indices` of parameter `name`, whose full shape is `full_shape`."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: Sequence[int]

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.full_shape)

    @property
    def nnz(self) -> int:
        """Entries the patch sets."""
        return int(self.indices.numel())

    @property
    def nbytes(self) -> int:
        """Bytes the patch puts on the wire: its indices and its values."""
        return self.nnz * (self.indices.element_size() + self.values.element_size())


def check_indices(indices: torch.Tensor, numel: int, where: str) -> None:
    """`ValueError` (prefixed with `where`) unless `indices` are unique and in `[0, numel)`."""
    n = int(indices.numel())
    if n == 0:
        return
    outside = (indices < 0) | (indices >= numel)
    if bool(outside.any()):
        pos = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"{where}: index {int(indices[pos])} at position {pos} is outside [0, {numel})"
        )
    if n > 1:
        ordered = torch.sort(indices).values
        repeated = ordered[1:] == ordered[:-1]
        if bool(repeated.any()):
            value = int(ordered[1:][repeated][0])
            raise ValueError(f"{where}: index {value} appears more than once")


def check_indices_of(patches: Sequence[SparseWeightPatch], where: Sequence[str]) -> None:
    """`check_indices` of every patch (`where[i]` names patch `i` in the error), with one
    host read for the whole batch: each patch's range and uniqueness checks run on the
    device into a flag, and the host reads the flags once; only a batch that fails is
    checked patch by patch to name the first bad one. Each patch is sorted on its own,
    so the extra memory is one patch's, never the batch's."""

    def one_by_one() -> None:
        for patch, named in zip(patches, where, strict=True):
            check_indices(patch.indices, patch.numel, named)

    device = patches[0].indices.device if patches else None
    if any(p.indices.device != device for p in patches):
        one_by_one()
        return
    flags = []
    for patch in patches:
        indices = patch.indices
        if indices.numel() == 0:
            continue
        bad = ((indices < 0) | (indices >= patch.numel)).any()
        if indices.numel() > 1:
            ordered = torch.sort(indices).values
            bad = bad | (ordered[1:] == ordered[:-1]).any()
        flags.append(bad.reshape(1))
    if flags and bool(torch.cat(flags).any()):
        one_by_one()


def _check_patch(patch: SparseWeightPatch, where: str) -> None:
    if not isinstance(patch.name, str) or not patch.name:
        raise ValueError(f"{where}: name must be a non-empty string")
    shape = patch.full_shape
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(
            f"{where}: full_shape must be a sequence of non-negative ints, got {shape!r}"
        )
    for field in ("indices", "values"):
        t = getattr(patch, field)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {field} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{where}: {field} must be 1-D, got shape {tuple(t.shape)}")
    if patch.indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"{where}: indices must be int32 or int64, got {patch.indices.dtype}")
    try:
        dtype_name(patch.values.dtype)
    except ValueError as e:
        raise ValueError(f"{where}: values: {e}") from None
    if patch.values.numel() != patch.indices.numel():
        raise ValueError(
            f"{where}: {patch.indices.numel()} indices but {patch.values.numel()} values"
        )


def check_patches(patches: Sequence[SparseWeightPatch]) -> None:
    """Check every patch; `ValueError` naming the first bad one as `patch <i> (<name>)`.

    Raises `TypeError` for an entry that is not a `SparseWeightPatch`.
    """
    where = []
    for i, patch in enumerate(patches):
        if not isinstance(patch, SparseWeightPatch):
            raise TypeError(f"patch {i}: expected a SparseWeightPatch, got {type(patch).__name__}")
        where.append(f"patch {i} ({patch.name!r})")
        _check_patch(patch, where[-1])
    check_indices_of(patches, where)


def check_dtype(
    values: torch.dtype, target: torch.dtype, cast: bool, where: str, what: str
) -> None:
    """Refuse `values` for a tensor of dtype `target`, unless they are equal or, with
    `cast`, both floating point (the values are then cast)."""
    if values == target or (cast and values.is_floating_point and target.is_floating_point):
        return
    remedy = "" if cast else " (cast_values=True on the trainer casts floating-point values)"
    raise ValueError(f"{where}: values are {values}, {what} is {target}{remedy}")
