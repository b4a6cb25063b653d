"""Verified bytes: a digest of every piece a bucketed wire moves, and the worker's check.

The digest of a run of bytes is a Fletcher-style pair computed with torch ops
on the bytes' own device (CPU or CUDA; nothing is copied to the host):
the bytes are read as little-endian 32-bit words `w_0 .. w_{m-1}` (a tail of
1-3 bytes is one more word, zero-padded), widened to int64, and

    S1 = sum(w_i)            S2 = sum((i + 1) * w_i)        (both modulo 2**64)

A flipped byte changes one word by `d * 256**p` with `0 < |d| < 256`, so S1
changes by a nonzero amount below 2**40: always detected. Two distinct
words swapped leave S1 and change S2 by `(i - j) * (w_j - w_i)`, nonzero and
below 2**63 in magnitude for pieces under 8 GiB: always detected. Both sides
compute the same sums; int64 additions and products wrap modulo 2**64 in
torch on CPU and CUDA alike, so the order of a reduction never matters.

Per bucket, `BucketDigests.of(k, buf)` is one small `int64[pieces, 2]`
tensor: the digest of each piece of bucket `k` (a whole tensor, or the byte
range of a split one) as it lies in `buf`. Pieces of at least `LARGE_BYTES`
are summed piece by piece in chunks; smaller ones are batched through prefix
sums over windows of the bucket, so a bucket of thousands of small tensors
costs a few torch calls, not thousands.

Worker: `BucketDigests.check(k, buf, expected)` raises `DigestMismatch`
naming the bucket and the first parameter whose bytes differ; core's
`LoadPipeline.received` runs it before the bucket's load, so nothing of a
corrupt bucket is loaded and the round fails (the engine rolls back).

`DigestRoom` is where a fixed staging buffer keeps its bucket's digests (the
`ipc` wire): the tail of every buffer, after at most `max_pieces` pieces of
bucket bytes; both ends derive it from the buffer size.

Test-only transport hook: `RECEIVE_HOOKS`, a list of callables `hook(k,
buf)` run by `LoadPipeline.received` right after bucket `k` landed in `buf`
and before it is checked. Tests append a hook that flips a byte and remove
it afterwards; production code never touches the list.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weight_transfer.transport.packing import ALIGNMENT, Bucket, BucketPlan, as_bytes

__all__ = [
    "digest",
    "BucketDigests",
    "DigestMismatch",
    "DigestRoom",
    "RECEIVE_HOOKS",
    "run_receive_hooks",
    "DIGEST_DTYPE",
]

DIGEST_DTYPE = torch.int64
LARGE_BYTES = 256 << 10  # pieces at least this long are summed on their own
WINDOW_WORDS = 1 << 18  # words per torch call (2 MiB per int64 scratch buffer)

# Test-only: `hook(bucket_index, received_bytes)` after a bucket lands, before its check.
RECEIVE_HOOKS: list[Callable[[int, torch.Tensor], None]] = []


def run_receive_hooks(k: int, buf: torch.Tensor) -> None:
    """Run the test-only `RECEIVE_HOOKS` on bucket `k`'s received bytes."""
    for hook in list(RECEIVE_HOOKS):
        hook(k, buf)


class DigestMismatch(RuntimeError):
    """A received piece differs from what the trainer sent; names the bucket and parameter."""

    def __init__(self, message: str, *, bucket: int, param: str) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.param = param


def _words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`data` (flat uint8) as its int32 words and its tail bytes (a copy if misaligned)."""
    whole = data.numel() // 4 * 4
    body = data[:whole]
    if body.storage_offset() % 4:
        body = body.clone()
    return body.view(torch.int32), data[whole:]


class _Scratch(threading.local):
    """Per thread and device: position weights `1..WINDOW_WORDS`, byte shifts and int64
    work buffers, allocated once (fresh buffers per call page-fault on CPU). Per
    thread, because a trainer and a worker may digest in one process at once."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def get(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self.by_device:
            self.by_device[device] = {
                "weights": torch.arange(1, WINDOW_WORDS + 1, dtype=DIGEST_DTYPE, device=device),
                "shifts": torch.tensor([1, 1 << 8, 1 << 16], dtype=DIGEST_DTYPE, device=device),
                "wide": torch.empty(WINDOW_WORDS, dtype=DIGEST_DTYPE, device=device),
                "c1": torch.zeros(WINDOW_WORDS + 1, dtype=DIGEST_DTYPE, device=device),
                "c2": torch.zeros(WINDOW_WORDS + 1, dtype=DIGEST_DTYPE, device=device),
            }
        return self.by_device[device]


_SCRATCH = _Scratch()


def _sum_into(out: torch.Tensor, words: torch.Tensor, tail: torch.Tensor) -> None:
    """Add into `out` (int64[2]) the digest of `words` (int32), then `tail`'s tail word."""
    scratch = _SCRATCH.get(words.device)
    m = words.numel()
    for start in range(0, m, WINDOW_WORDS):
        chunk = words[start : start + WINDOW_WORDS]
        wide = scratch["wide"][: chunk.numel()].copy_(chunk)
        s1 = wide.sum()
        s2 = wide.mul_(scratch["weights"][: chunk.numel()]).sum()
        out[0] += s1
        out[1] += s2 + start * s1
    if tail.numel():
        word = (tail.to(DIGEST_DTYPE) * scratch["shifts"][: tail.numel()]).sum()
        out[0] += word
        out[1] += (m + 1) * word


def digest(data: torch.Tensor) -> torch.Tensor:
    """The digest `int64[S1, S2]` of `data`'s bytes, on `data`'s device (module docstring)."""
    flat = as_bytes(data)
    out = torch.zeros(2, dtype=DIGEST_DTYPE, device=flat.device)
    words, tail = _words(flat)
    _sum_into(out, words, tail)
    return out


@dataclass(frozen=True)
class _Window:
    """Small pieces lying in words `[start, stop)` of a bucket, batched in one pass."""

    start: int
    stop: int
    rows: list[int]  # the pieces' indexes in the bucket
    begin: list[int]  # each piece's first word, relative to `start`
    end: list[int]  # one past each piece's last whole word, relative to `start`


@dataclass(frozen=True)
class _Layout:
    """How one bucket's digests are computed: large pieces, windows, tail bytes."""

    large: list[int]
    windows: list[_Window]
    tail_rows: list[int]  # per tail byte: its piece
    tail_at: list[int]  # per tail byte: its offset in the bucket
    tail_shift: list[int]  # per tail byte: its place in the tail word (0, 1, 2)
    tail_weight: list[int]  # per tail byte: its piece's tail-word position + 1


def _layout(bucket: Bucket) -> _Layout:
    large: list[int] = []
    windows: list[_Window] = []
    tail_rows: list[int] = []
    tail_at: list[int] = []
    tail_shift: list[int] = []
    tail_weight: list[int] = []
    rows: list[int] = []
    spans: list[tuple[int, int]] = []

    def flush() -> None:
        if rows:
            start = spans[0][0]
            windows.append(
                _Window(
                    start,
                    spans[-1][1],
                    list(rows),
                    [a - start for a, _ in spans],
                    [b - start for _, b in spans],
                )
            )
        rows.clear()
        spans.clear()

    for j, piece in enumerate(bucket.pieces):
        if piece.offset % 4:
            raise ValueError(f"piece {j} starts at byte {piece.offset}, not on a word")
        first, count = piece.offset // 4, piece.nbytes // 4
        for b in range(piece.nbytes % 4):
            tail_rows.append(j)
            tail_at.append(piece.offset + 4 * count + b)
            tail_shift.append(b)
            tail_weight.append(count + 1)
        if piece.nbytes >= LARGE_BYTES:
            large.append(j)
            continue
        if count == 0:
            continue
        if rows and first + count - spans[0][0] > WINDOW_WORDS:
            flush()
        rows.append(j)
        spans.append((first, first + count))
    flush()
    return _Layout(large, windows, tail_rows, tail_at, tail_shift, tail_weight)


class BucketDigests:
    """The digests of a plan's buckets (module docstring); per-bucket layouts built on first use."""

    def __init__(self, plan: BucketPlan) -> None:
        self.plan = plan
        self._layouts: dict[int, _Layout] = {}
        self._indexes: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}

    @classmethod
    def of_plan(cls, plan: BucketPlan) -> BucketDigests:
        """The plan's own instance (kept in `plan.derived`), so layouts are built once
        for as long as a trainer reuses its plan (`PlanCache`)."""
        found = plan.derived.get("digests")
        if not isinstance(found, BucketDigests):
            found = plan.derived["digests"] = cls(plan)
        return found

    def _layout(self, k: int) -> _Layout:
        if k not in self._layouts:
            self._layouts[k] = _layout(self.plan.buckets[k])
        return self._layouts[k]

    def _index(self, k: int, device: torch.device) -> dict[str, torch.Tensor]:
        key = (k, device)
        if key not in self._indexes:
            layout = self._layout(k)

            def tensor(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            index = {
                "tail_rows": tensor(layout.tail_rows),
                "tail_at": tensor(layout.tail_at),
                "tail_shift": tensor([1 << (8 * s) for s in layout.tail_shift]),
                "tail_weight": tensor(layout.tail_weight),
            }
            for i, w in enumerate(layout.windows):
                index[f"rows{i}"] = tensor(w.rows)
                index[f"begin{i}"] = tensor(w.begin)
                index[f"end{i}"] = tensor(w.end)
            self._indexes[key] = index
        return self._indexes[key]

    def of(self, k: int, buf: torch.Tensor) -> torch.Tensor:
        """`int64[pieces, 2]`: the digest of each piece of bucket `k` as it lies in `buf`."""
        bucket = self.plan.buckets[k]
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < bucket.nbytes:
            raise ValueError(
                f"bucket {k} needs a flat uint8 buffer of {bucket.nbytes} bytes, got "
                f"{buf.dtype} {tuple(buf.shape)}"
            )
        buf = buf[: bucket.nbytes]
        layout, index = self._layout(k), self._index(k, buf.device)
        out = torch.zeros(len(bucket.pieces), 2, dtype=DIGEST_DTYPE, device=buf.device)
        words, _ = _words(buf)
        no_tail = buf[:0]
        for j in layout.large:
            piece = bucket.pieces[j]
            first = piece.offset // 4
            _sum_into(out[j], words[first : first + piece.nbytes // 4], no_tail)
        scratch = _SCRATCH.get(buf.device)
        for i, window in enumerate(layout.windows):
            n = window.stop - window.start
            wide = scratch["wide"][:n].copy_(words[window.start : window.stop])
            c1, c2 = scratch["c1"], scratch["c2"]  # c[0] stays 0: sums of no word
            torch.cumsum(wide, 0, out=c1[1 : n + 1])
            torch.cumsum(wide.mul_(scratch["weights"][:n]), 0, out=c2[1 : n + 1])
            begin, end = index[f"begin{i}"], index[f"end{i}"]
            s1 = c1[end] - c1[begin]
            # c2 weighs word l of the window by l + 1; a piece from word `begin` by l + 1 - begin
            s2 = c2[end] - c2[begin] - begin * s1
            out.index_put_((index[f"rows{i}"],), torch.stack((s1, s2), dim=1), accumulate=True)
        if layout.tail_rows:
            words_of_tail = buf[index["tail_at"]].to(DIGEST_DTYPE) * index["tail_shift"]
            rows = index["tail_rows"]
            out[:, 0].index_add_(0, rows, words_of_tail)
            out[:, 1].index_add_(0, rows, words_of_tail * index["tail_weight"])
        return out

    def check(self, k: int, buf: torch.Tensor, expected: torch.Tensor) -> None:
        """Raise `DigestMismatch` naming the first piece of bucket `k` whose bytes differ."""
        bucket = self.plan.buckets[k]
        shape = (len(bucket.pieces), 2)
        if tuple(expected.shape) != shape or expected.dtype != DIGEST_DTYPE:
            raise ValueError(
                f"the trainer's digests of bucket {k} are {expected.dtype} "
                f"{tuple(expected.shape)}, expected int64 {shape}"
            )
        mine = self.of(k, buf)
        expected = expected.to(mine.device)
        if torch.equal(mine, expected):
            return
        j = int((mine != expected).any(dim=1).nonzero()[0, 0])
        piece = bucket.pieces[j]
        meta = self.plan.params[piece.param]
        where = (
            "its bytes"
            if piece.nbytes == meta.nbytes
            else f"bytes {piece.start}..{piece.start + piece.nbytes} of {meta.nbytes}"
        )
        raise DigestMismatch(
            f"verify: bucket {k} of {len(self.plan.buckets)}: parameter {meta.name!r} "
            f"({where}) arrived different from what the trainer sent (digest "
            f"{mine[j].tolist()} != {expected[j].tolist()}); the round is refused before "
            "this bucket is loaded",
            bucket=k,
            param=meta.name,
        )


@dataclass(frozen=True)
class DigestRoom:
    """Where a fixed staging buffer of `buffer_bytes` keeps its bucket's digests.

    Bucket bytes use `[0, offset)`; the digests of at most `max_pieces`
    pieces lie at `offset` as `int64[pieces, 2]`. One buffer in 64 holds
    digests room (at most 1 MiB). Both ends derive it from the buffer size.
    """

    buffer_bytes: int
    offset: int
    max_pieces: int

    @classmethod
    def of(cls, buffer_bytes: int) -> DigestRoom:
        max_pieces = max(1, min(buffer_bytes // 1024, 1 << 16))
        room = (16 * max_pieces + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        offset = buffer_bytes - room
        if offset < ALIGNMENT:
            raise ValueError(
                f"field 'packed_buffer_size_bytes' is {buffer_bytes}: with verify=True a "
                f"staging buffer needs at least {room + ALIGNMENT} bytes (room for digests)"
            )
        return cls(buffer_bytes, offset, max_pieces)

    def view(self, slot: torch.Tensor, pieces: int) -> torch.Tensor:
        """The `int64[pieces, 2]` digests region of staging buffer `slot`."""
        if pieces > self.max_pieces or slot.numel() < self.buffer_bytes:
            raise ValueError(
                f"a bucket of {pieces} pieces in a buffer of {slot.numel()} bytes: the digest "
                f"room holds {self.max_pieces} pieces of a {self.buffer_bytes}-byte buffer"
            )
        region = slot[self.offset : self.offset + 16 * pieces]
        return region.view(DIGEST_DTYPE).view(pieces, 2)
