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

`plan_per_tensor` is the unpacked layout for fixed buffers: every parameter
starts a bucket of its own (split across buckets when larger than a buffer),
while `group_end` still follows the layers, so the view rule below holds.

`WireParams` are the must-agree parameters of a bucketed wire (mixed into a
backend's init infos); `Packer` copies consecutive buckets out of a checked
source iteration, a batched copy and at most one host read per bucket;
`Unpacker` turns received buckets back into tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer.runtime.finite import first_non_finite, non_finite_error
from weight_transfer.runtime.limits import (
    MAX_BUFFERS,
    check_int_range,
    check_staging,
    host_memory_bytes,
)
from weight_transfer.runtime.phases import timed
from weight_transfer.source import ParamMeta, layerwise_groups

__all__ = [
    "ALIGNMENT",
    "Piece",
    "Bucket",
    "BucketPlan",
    "plan_buckets",
    "plan_per_tensor",
    "aligned_layout",
    "as_bytes",
    "floating_runs",
    "piece_view",
    "WireParams",
    "PlanCache",
    "Packer",
    "RotatingBuffers",
    "Unpacker",
]

ALIGNMENT = 64
DEFAULT_BUFFER_BYTES = 1 << 30
DEFAULT_MIN_BUCKET_BYTES = 32 << 20


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def aligned_layout(sizes: Sequence[int], start: int = 0) -> tuple[list[int], int]:
    """Offsets of pieces of `sizes` bytes laid out in order from byte `start`, each
    `ALIGNMENT`-aligned, and where the layout ends. Empty pieces take no room. Both
    ends of a wire derive a layout with this, so it is never sent."""
    offsets: list[int] = []
    cursor = start
    for size in sizes:
        if size < 0:
            raise ValueError(f"a piece of {size} bytes")
        offset = _align(cursor)
        offsets.append(offset)
        cursor = offset + size
    return offsets, cursor


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
    """A layout: the parameters, the buckets and, per parameter, its group's last bucket.

    `derived` holds what is computed once per plan from it (the digest
    layouts of `digests.BucketDigests.of_plan`); it takes no part in equality.
    """

    params: tuple[ParamMeta, ...]
    buckets: tuple[Bucket, ...]
    group_end: tuple[int, ...]
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
    max_pieces: int | None = None,
) -> BucketPlan:
    """Lay `metas` out in buckets of at most `buffer_bytes` (see the module docstring).

    `groups` defaults to `layerwise_groups` of the names and must partition
    them in metadata order. `max_pieces` (default: no limit) also closes a
    bucket that holds that many pieces, as a full one is closed (a fixed
    staging buffer keeps one digest per piece: `digests.DigestRoom`).

    The plans of the last few layouts are kept: the same layout gets the same
    `BucketPlan` object, round after round and on both sides of an in-process
    wire, so what is derived once per plan (its buffers' piece views, its
    digest layouts) is made once.
    """
    key = (tuple(metas), buffer_bytes, min_bucket_bytes, max_pieces)
    if groups is None:
        with _recent_lock:
            for i, (kept, plan) in enumerate(_recent_plans):
                if kept == key:
                    _recent_plans.insert(0, _recent_plans.pop(i))
                    return plan
    plan = _plan_buckets(metas, buffer_bytes, min_bucket_bytes, groups, max_pieces)
    if groups is None:
        with _recent_lock:
            _recent_plans.insert(0, (key, plan))
            del _recent_plans[_RECENT_PLANS:]
    return plan


_RECENT_PLANS = 4
_recent_lock = threading.Lock()
_recent_plans: list[tuple[tuple[Any, ...], BucketPlan]] = []


def _plan_buckets(
    metas: Sequence[ParamMeta],
    buffer_bytes: int,
    min_bucket_bytes: int,
    groups: Sequence[Sequence[str]] | None,
    max_pieces: int | None,
) -> BucketPlan:
    if buffer_bytes < ALIGNMENT:
        raise ValueError(f"buffer_bytes must be at least {ALIGNMENT}, got {buffer_bytes}")
    if max_pieces is not None and max_pieces < 1:
        raise ValueError(f"max_pieces must be at least 1, got {max_pieces}")
    piece_limit = max_pieces or len(metas) + 1
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
            if len(pieces) >= piece_limit:
                close()
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


def plan_per_tensor(metas: Sequence[ParamMeta], *, buffer_bytes: int) -> BucketPlan:
    """One parameter per bucket (split when larger than `buffer_bytes`); layers as groups."""
    alone = plan_buckets(metas, buffer_bytes=buffer_bytes, groups=[[m.name] for m in metas])
    last_bucket = [0] * len(metas)
    for k, bucket in enumerate(alone.buckets):
        for piece in bucket.pieces:
            last_bucket[piece.param] = k
    group_end: list[int] = []
    index = 0
    for group in layerwise_groups([m.name for m in metas]):
        members = range(index, index + len(group))
        index += len(group)
        end = max(last_bucket[i] for i in members)
        group_end.extend(end for _ in members)
    return BucketPlan(alone.params, alone.buckets, tuple(group_end))


@dataclass
class WireParams:
    """Must-agree parameters of a bucketed wire; the trainer is their only source.

    Mixed into a backend's trainer and worker init infos; `wire` is a
    detached copy that engines keep.
    """

    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = 2
    packed_min_bucket_bytes: int = DEFAULT_MIN_BUCKET_BYTES
    # Verified bytes: the trainer sends a digest of every piece, and each
    # worker checks the bytes it received before the bucket is loaded
    # (`digests.py`); a mismatch fails the round naming the parameter.
    verify: bool = False

    def validate(self, what: str, *, staged: bool | None = None) -> None:
        """Raise `ValueError` naming the field, the value and the limit.

        The staging limit applies when buffers are allocated (`staged`; by
        default when `packed`).
        """
        check_int_range(
            self.packed_buffer_size_bytes,
            field="packed_buffer_size_bytes",
            what=what,
            low=ALIGNMENT,
            high=host_memory_bytes(),
        )
        check_int_range(
            self.packed_num_buffers, field="packed_num_buffers", what=what, low=1, high=MAX_BUFFERS
        )
        check_int_range(
            self.packed_min_bucket_bytes,
            field="packed_min_bucket_bytes",
            what=what,
            low=0,
            high=host_memory_bytes(),
        )
        if not isinstance(self.verify, bool):
            raise ValueError(f"{what}: field 'verify' must be a bool, got {self.verify!r}")
        if self.packed if staged is None else staged:
            check_staging(
                self.packed_buffer_size_bytes,
                self.packed_num_buffers,
                field="packed_buffer_size_bytes",
                what=what,
            )

    def packed_plan(self, metas: Sequence[ParamMeta]) -> BucketPlan:
        """The packed layout of `metas` under these parameters (`plan_buckets`)."""
        return plan_buckets(
            metas,
            buffer_bytes=self.packed_buffer_size_bytes,
            min_bucket_bytes=self.packed_min_bucket_bytes,
        )

    @property
    def wire(self) -> WireParams:
        return WireParams(
            self.packed,
            self.packed_buffer_size_bytes,
            self.packed_num_buffers,
            self.packed_min_bucket_bytes,
            self.verify,
        )


class PlanCache:
    """`plan(metas)` of the last parameter list, recomputed only when the list changes.

    A trainer plans every round (`num_chunks`, then `transmit`); the layout of
    an unchanged model is the same, and planning thousands of parameters is
    not free.
    """

    def __init__(self, plan: Callable[[list[ParamMeta]], BucketPlan]) -> None:
        self.plan = plan
        self._key: tuple[ParamMeta, ...] | None = None
        self._plan: BucketPlan | None = None

    def __call__(self, metas: list[ParamMeta]) -> BucketPlan:
        key = tuple(metas)
        if self._plan is None or key != self._key:
            self._plan, self._key = self.plan(metas), key
        return self._plan


class Packer:
    """Copies the buckets of `plan`, in order, out of checked `(meta, tensor)` pairs.

    Per bucket, whatever its number of parameters: one batched copy
    (`torch._foreach_copy_`) into views of its buffer that `RotatingBuffers.views`
    made once, and with `finite`, one batched finite check of what was copied,
    whose result the host reads once (`first_non_finite`). The refusal names the
    first non-finite parameter; nothing of its bucket has gone out. A parameter
    split across buckets is checked whole at its first piece, and copied piece by
    piece as bytes.
    """

    def __init__(
        self,
        plan: BucketPlan,
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        *,
        finite: bool = False,
    ) -> None:
        self.plan = plan
        self.pairs = pairs
        self.finite = finite
        self.current: torch.Tensor | None = None  # bytes of the split parameter being packed

    def bytes_of(self, k: int, buffers: RotatingBuffers) -> torch.Tensor:
        """Bucket `k`'s bytes for a transport that sends from any memory: a bucket of one
        piece (a tensor alone in its bucket, or a piece of one larger than a bucket) of a
        contiguous tensor on the buffers' device is its own bytes, with no pack copy; any
        other bucket is `pack`ed. Checked as `pack` checks. The caller keeps what it gets
        alive, and the source unchanged, until its sends complete."""
        (piece, *more) = self.plan.buckets[k].pieces
        meta = self.plan.params[piece.param]
        if more or piece.nbytes == 0:
            return self.pack(k, buffers)
        if piece.start == 0:
            tensor = next(self.pairs)[1]
            if self.finite:
                with timed("check"):
                    bad = first_non_finite([tensor])
                if bad is not None:
                    raise non_finite_error(meta.name, piece.param)
            if tensor.device != buffers.device or not tensor.is_contiguous():
                return self._pack_one(k, buffers, tensor)
            self.current = tensor.reshape(-1).view(torch.uint8)
        assert self.current is not None
        if self.current.device != buffers.device:
            return self._pack_one(k, buffers, None)
        return self.current[piece.start : piece.start + piece.nbytes]

    def _pack_one(
        self, k: int, buffers: RotatingBuffers, tensor: torch.Tensor | None
    ) -> torch.Tensor:
        """Bucket `k` (one piece, already checked) copied into its buffer: from `tensor`
        when it is the piece's first, else from the split parameter's bytes."""
        (piece,) = self.plan.buckets[k].pieces
        if tensor is not None:
            self.current = as_bytes(tensor)
        assert self.current is not None
        out = buffers.get(k, self.plan.buckets[k].nbytes)
        with timed("pack"):
            out[piece.offset : piece.offset + piece.nbytes].copy_(
                self.current[piece.start : piece.start + piece.nbytes]
            )
        return out

    def pack(self, k: int, buffers: RotatingBuffers) -> torch.Tensor:
        """Fill bucket `k`'s buffer with its pieces; returns its `nbytes` bytes."""
        bucket = self.plan.buckets[k]
        out = buffers.get(k, bucket.nbytes)
        views = buffers.views(self.plan, k)
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        checked: list[torch.Tensor] = []  # in piece order: what `finite` checks
        checked_params: list[int] = []
        split: list[torch.Tensor] = []  # of those, the split parameters' source tensors
        for piece, view in zip(bucket.pieces, views, strict=True):
            whole = piece.nbytes == self.plan.params[piece.param].nbytes
            if whole or piece.start == 0:
                tensor = next(self.pairs)[1]
                if self.finite:
                    checked.append(view if whole else tensor)
                    checked_params.append(piece.param)
                    if not whole:
                        split.append(tensor)
                if whole:
                    if piece.nbytes:
                        targets.append(view)
                        sources.append(tensor)
                    continue
                self.current = as_bytes(tensor)
            assert self.current is not None
            targets.append(view)
            sources.append(self.current[piece.start : piece.start + piece.nbytes])
        if targets:
            with timed("pack"):
                torch._foreach_copy_(targets, sources)
        if checked:
            with timed("check"):
                bad = self._first_non_finite(k, out, checked, split)
            if bad is not None:
                param = checked_params[bad]
                raise non_finite_error(self.plan.params[param].name, param)
        return out

    def _first_non_finite(
        self, k: int, out: torch.Tensor, checked: list[torch.Tensor], split: list[torch.Tensor]
    ) -> int | None:
        """`first_non_finite(checked)`, reduced over the packed bucket `out`: one norm
        per run of adjacent whole pieces of one floating dtype (`float_runs`) instead of
        one per tensor, and one per `split` parameter; only a bucket that fails is
        looked at tensor by tensor, to name the parameter."""
        reduced = [out[a:b].view(dtype) for dtype, a, b in float_runs(self.plan, k)]
        if first_non_finite(reduced + split) is None:
            return None
        return first_non_finite(checked)

    def whole(self, k: int) -> torch.Tensor:
        """Bucket `k`'s only parameter as it came from the source (a plan of one
        whole tensor per bucket, sent without a copy), checked as `pack` checks."""
        (piece,) = self.plan.buckets[k].pieces
        tensor = next(self.pairs)[1]
        if self.finite and first_non_finite([tensor]) is not None:
            raise non_finite_error(self.plan.params[piece.param].name, piece.param)
        return tensor

    def exhaust(self) -> None:
        """Run the source to its end (the check for an extra parameter runs there)."""
        for _ in self.pairs:
            pass


def float_runs(plan: BucketPlan, k: int) -> list[tuple[torch.dtype, int, int]]:
    """Bucket `k`'s whole floating pieces as maximal runs `(dtype, start, end)` of
    adjacent bytes of one dtype (alignment padding ends a run: its bytes are not
    the source's). Made once per plan."""
    every = plan.derived.get("float_runs")
    if every is None:
        every = plan.derived["float_runs"] = {}
    runs = every.get(k)
    if runs is None:
        whole = [
            (plan.params[p.param].dtype, p.offset, p.nbytes)
            for p in plan.buckets[k].pieces
            if p.nbytes == plan.params[p.param].nbytes
        ]
        runs = every[k] = floating_runs(whole)
    return runs


def floating_runs(
    pieces: Iterable[tuple[torch.dtype, int, int]],
) -> list[tuple[torch.dtype, int, int]]:
    """The maximal runs `(dtype, start, end)` of adjacent pieces `(dtype, offset, nbytes)`
    of one floating dtype, in order; empty and non-floating pieces are skipped, and a
    gap between pieces (alignment padding) ends a run."""
    runs: list[tuple[torch.dtype, int, int]] = []
    for dtype, offset, nbytes in pieces:
        if not nbytes or not dtype.is_floating_point:
            continue
        if runs and runs[-1][0] == dtype and runs[-1][2] == offset:
            runs[-1] = (dtype, runs[-1][1], offset + nbytes)
        else:
            runs.append((dtype, offset, offset + nbytes))
    return runs


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat `uint8` view of `tensor`'s elements (a contiguous copy if needed)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def piece_view(buffer: torch.Tensor, piece: Piece, meta: ParamMeta) -> torch.Tensor:
    """Where `piece` lies in `buffer`: the whole parameter as its dtype and shape,
    or, for a piece of a split one, its bytes."""
    data = buffer[piece.offset : piece.offset + piece.nbytes]
    if piece.nbytes != meta.nbytes:
        return data
    return data.view(meta.dtype).view(meta.shape)


class RotatingBuffers:
    """`count` reusable `uint8` buffers on `device`, grown only when a plan needs more.

    Reusing buffers across buckets and syncs avoids the page faults of fresh
    allocations, which cost more than the copy itself on CPU. Each buffer keeps
    the piece views of the buckets of one plan (`views`), so a warm round makes
    no per-tensor views; they go with the buffer when it grows or is released.
    """

    def __init__(self, count: int, device: torch.device | str) -> None:
        if count < 1:
            raise ValueError(f"packed_num_buffers must be at least 1, got {count}")
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * count
        self._views: list[tuple[BucketPlan | None, dict[int, list[torch.Tensor]]]] = [
            (None, {}) for _ in range(count)
        ]
        self.fixed = False

    @classmethod
    def over(cls, buffers: Sequence[torch.Tensor]) -> RotatingBuffers:
        """Rotate over existing `uint8` buffers (shared memory, say); `get` never grows them."""
        rotating = cls(len(buffers), buffers[0].device)
        rotating._buffers = list(buffers)
        rotating.fixed = True
        return rotating

    def __len__(self) -> int:
        return len(self._buffers)

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer `index % count`, at least `nbytes` long, as a view of exactly `nbytes`."""
        slot = index % len(self._buffers)
        buf = self._buffers[slot]
        if buf.numel() < nbytes:
            if self.fixed:
                raise ValueError(
                    f"a bucket of {nbytes} bytes does not fit buffer {slot} ({buf.numel()} bytes)"
                )
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
            self._views[slot] = (None, {})
        return buf[:nbytes]

    def holds(self, k: int, buf: torch.Tensor) -> bool:
        """Whether `buf` is what `get(k, ...)` returned (bucket `k`'s slot, from its start)."""
        return (
            buf.numel() == 0 or buf.data_ptr() == self._buffers[k % len(self._buffers)].data_ptr()
        )

    def views(self, plan: BucketPlan, k: int) -> list[torch.Tensor]:
        """`piece_view`s of bucket `k` of `plan` in its buffer (which `get(k, ...)`
        sized), in piece order; made at the first call for this plan and buffer."""
        slot = k % len(self._buffers)
        owner, made = self._views[slot]
        if owner is not plan:
            made = {}
            self._views[slot] = (plan, made)
        views = made.get(k)
        if views is None:
            buf = self._buffers[slot]
            views = [piece_view(buf, p, plan.params[p.param]) for p in plan.buckets[k].pieces]
            made[k] = views
        return views

    def release(self) -> None:
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * len(self._buffers)
        self._views = [(None, {}) for _ in self._buffers]


class Unpacker:
    """Turns received buckets of one plan back into `(name, tensor)` pairs.

    `unpack(k, buf, view_horizon=h)` returns the parameters that complete in
    bucket `k`. A parameter held whole in the bucket comes back as a view into
    `buf` when its group ends at most `h` buckets later, else as a copy: a
    consumer that keeps a group's tensors until the group is complete (vLLM's
    layerwise reload does) must not see them change when `buf` is reused. A
    split parameter is assembled in its own tensor.

    With `buffers` (the `RotatingBuffers` every `buf` comes from, as
    `buffers.get(k, ...)`), the views are the buffers' own (`RotatingBuffers.views`),
    made once per plan: a warm round makes no per-tensor views.
    """

    def __init__(
        self,
        plan: BucketPlan,
        device: torch.device | str,
        buffers: RotatingBuffers | None = None,
    ) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.buffers = buffers
        self._partial: dict[int, torch.Tensor] = {}

    def unpack(
        self, k: int, buf: torch.Tensor, *, view_horizon: int = 0
    ) -> list[tuple[str, torch.Tensor]]:
        with timed("unpack"):
            return self._unpack(k, buf, view_horizon)

    def _views(self, k: int, buf: torch.Tensor) -> list[torch.Tensor]:
        if self.buffers is not None and self.buffers.holds(k, buf):
            return self.buffers.views(self.plan, k)
        return [piece_view(buf, p, self.plan.params[p.param]) for p in self.plan.buckets[k].pieces]

    def _unpack(
        self, k: int, buf: torch.Tensor, view_horizon: int
    ) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        params, group_end = self.plan.params, self.plan.group_end
        for piece, data in zip(self.plan.buckets[k].pieces, self._views(k, buf), strict=True):
            meta = params[piece.param]
            if piece.nbytes != meta.nbytes:  # `data` is the piece's bytes
                whole = self._partial.get(piece.param)
                if whole is None:
                    whole = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
                    self._partial[piece.param] = whole
                whole[piece.start : piece.start + piece.nbytes].copy_(data)
                if piece.start + piece.nbytes < meta.nbytes:
                    continue
                data = self._partial.pop(piece.param).view(meta.dtype).view(meta.shape)
            elif group_end[piece.param] - k > view_horizon:
                data = data.clone()
            out.append((meta.name, data))
        return out
