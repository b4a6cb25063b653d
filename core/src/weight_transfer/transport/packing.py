"""The packed-buffer layout, and the packing and unpacking that follow it.

`plan_buckets(metas, ...)` is a pure function of `ParamMeta`s and the wire
parameters, so trainer and workers compute identical layouts and no boundary
crosses the wire. Properties of a layout:

- A bucket is one message on the wire, at most `buffer_bytes` long.
- Every piece starts at a multiple of `ALIGNMENT` bytes, so a received piece
  can be viewed as its dtype in place, whatever dtypes precede it.
- Buckets end at gather-group (layer) boundaries: a bucket takes whole groups
  and is closed at the first group boundary after it reaches
  `min_bucket_bytes`, or before a group that would not fit in what is left.
  A group larger than a buffer spans consecutive buckets, and a tensor larger
  than a buffer is split into byte ranges across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.source import ParamMeta, layerwise_groups

__all__ = [
    "ALIGNMENT",
    "Piece",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "as_bytes",
    "RotatingBuffers",
    "Unpacker",
]

ALIGNMENT = 64


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Piece:
    """Bytes `[start, start + nbytes)` of parameter `param`, at `offset` in its bucket."""

    param: int
    start: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One wire message: its pieces in order and its length in bytes."""

    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """A layout: the parameters, the buckets and, per parameter, its group's last bucket."""

    params: tuple[ParamMeta, ...]
    buckets: tuple[Bucket, ...]
    group_end: tuple[int, ...]

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def plan_buckets(
    metas: Sequence[ParamMeta],
    *,
    buffer_bytes: int,
    min_bucket_bytes: int = 0,
    groups: Sequence[Sequence[str]] | None = None,
) -> BucketPlan:
    """Lay `metas` out in buckets of at most `buffer_bytes` (see the module docstring).

    `groups` defaults to `layerwise_groups` of the names and must partition
    them in metadata order.
    """
    if buffer_bytes < ALIGNMENT:
        raise ValueError(f"buffer_bytes must be at least {ALIGNMENT}, got {buffer_bytes}")
    names = [m.name for m in metas]
    if groups is None:
        groups = layerwise_groups(names)
    if [n for g in groups for n in g] != names:
        raise ValueError("groups must partition the parameter names in metadata order")

    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0  # bytes of the open bucket
    group_end = [0] * len(metas)

    def close() -> None:
        nonlocal pieces, used
        if pieces:
            buckets.append(Bucket(tuple(pieces), used))
        pieces, used = [], 0

    index = 0
    for group in groups:
        members = range(index, index + len(group))
        index += len(group)
        group_bytes = sum(_align(metas[i].nbytes) for i in members)
        fits_empty = group_bytes <= buffer_bytes
        if pieces and (
            used >= min_bucket_bytes or (fits_empty and _align(used) + group_bytes > buffer_bytes)
        ):
            close()
        for i in members:
            size = metas[i].nbytes
            if size == 0:  # an empty range fits in any bucket and never closes one
                pieces.append(Piece(i, 0, 0, 0))
                continue
            if pieces and _align(used) + size > buffer_bytes and size <= buffer_bytes:
                close()
            start = 0
            while True:
                offset = _align(used)
                if offset >= buffer_bytes:
                    close()
                    offset = 0
                take = min(size - start, buffer_bytes - offset)
                pieces.append(Piece(i, start, take, offset))
                used = offset + take
                start += take
                if start >= size:
                    break
                close()
        for i in members:
            group_end[i] = len(buckets)  # the open bucket holds the group's last piece
    close()
    return BucketPlan(tuple(metas), tuple(buckets), tuple(group_end))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat `uint8` view of `tensor`'s elements (a contiguous copy if needed)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class RotatingBuffers:
    """`count` reusable `uint8` buffers on `device`, grown only when a plan needs more.

    Reusing buffers across buckets and syncs avoids the page faults of fresh
    allocations, which cost more than the copy itself on CPU.
    """

    def __init__(self, count: int, device: torch.device | str) -> None:
        if count < 1:
            raise ValueError(f"packed_num_buffers must be at least 1, got {count}")
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * count

    def __len__(self) -> int:
        return len(self._buffers)

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer `index % count`, at least `nbytes` long, as a view of exactly `nbytes`."""
        slot = index % len(self._buffers)
        buf = self._buffers[slot]
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
        return buf[:nbytes]

    def release(self) -> None:
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * len(self._buffers)


class Unpacker:
    """Turns received buckets of one plan back into `(name, tensor)` pairs.

    `unpack(k, buf, view_horizon=h)` returns the parameters that complete in
    bucket `k`. A parameter held whole in the bucket comes back as a view into
    `buf` when its group ends at most `h` buckets later, else as a copy: a
    consumer that keeps a group's tensors until the group is complete (vLLM's
    layerwise reload does) must not see them change when `buf` is reused. A
    split parameter is assembled in its own tensor.
    """

    def __init__(self, plan: BucketPlan, device: torch.device | str) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self._partial: dict[int, torch.Tensor] = {}

    def unpack(
        self, k: int, buf: torch.Tensor, *, view_horizon: int = 0
    ) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for piece in self.plan.buckets[k].pieces:
            meta = self.plan.params[piece.param]
            data = buf[piece.offset : piece.offset + piece.nbytes]
            if piece.nbytes != meta.nbytes:
                whole = self._partial.get(piece.param)
                if whole is None:
                    whole = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
                    self._partial[piece.param] = whole
                whole[piece.start : piece.start + piece.nbytes].copy_(data)
                if piece.start + piece.nbytes < meta.nbytes:
                    continue
                data = self._partial.pop(piece.param)
            elif self.plan.group_end[piece.param] - k > view_horizon:
                data = data.clone()
            out.append((meta.name, data.view(meta.dtype).view(meta.shape)))
        return out
