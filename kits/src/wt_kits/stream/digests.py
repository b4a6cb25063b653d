"""Verified bytes: a digest of every piece a bucketed wire moves, and the worker's check.

The digest of a run of bytes is a pair of 64-bit lanes computed with torch
ops on the bytes' own device (CPU or CUDA; nothing is copied to the host).
The bytes are read as 32-bit words `w_0 .. w_{m-1}` (little-endian, signed);
a tail of 1-3 bytes is one more word `w_m`, its bytes zero-padded and read
unsigned. With the lanes' arithmetic modulo 2**64:

    A = sum(KA**i * w_i)
    B = sum(KB**i * mix(w_i)),  mix(x) = u ^ (u >> 16), u = MIX * x mod 2**32

where `KA`, `KB` (64-bit) and `MIX` (32-bit) are fixed odd constants, `>>`
is a logical shift and `mix(x)` is read as a signed 32-bit word. Lane A
weighs each word by a power of `KA`; lane B first mixes each word
non-linearly (`mix` is a bijection of 32-bit words that brings the high
bits of the product down into the low ones) and weighs it by a power of
`KB`. Products and sums wrap alike in torch on CPU and CUDA, so trainer and
worker compute the same lanes and the order of a reduction never matters.

What it detects, for pieces under 2**31 words (8 GiB). `d` is a change of
one word (`0 < |d| < 2**32`), `v(n)` the number of factors 2 in `n`; a
lane's change is nonzero when its factors 2 number fewer than 64:

- every change confined to one word (a flipped bit or byte, a tail): lane A
  changes by `KA**i * d`, `KA` odd; lane B alike, `mix` being a bijection;
- every exchange of two words `s` apart: both lanes change by
  `(K**i - K**(i+s)) * (difference of the two words, or of their mixes)`,
  and `v(1 - K**s) <= 2 + v(s)` for both bases (`KA = 5`, `KB = 3 mod 8`);
- every pair `(+d, -d)` or `(+d, +d)` at any distance `s`: lane A changes by
  `KA**i * d * (1 -/+ KA**s)`, `v(1 + KA**s) = 1`;
- `(+c, -2c, +c)` on three consecutive words, or on words `s` apart for `s`
  under 2**15, and `(+c, -c, -c, +c)` on four consecutive words: lane A
  changes by `KA**i * c * (1 - KA**s)**2` and `KA**i * c * (1 - KA)(1 - KA**2)`.

A change that lane A misses solves `sum(KA**i * d_i) = 0 mod 2**64`: long
patterns exist (+-1 on 2**10 words in Thue-Morse order), and short ones in
the high bits (the signs of the words at 0, 2**14, 2**15 and 3 * 2**14
flipped, when the four changes come out +2**31, -2**31, -2**31, +2**31).
It still has to cancel lane B, whose terms depend non-linearly on the
words' values: we know of no small pattern (a few words, a run zeroed, a
word moved) that does, and expect one change in about 2**64 to pass both.
The digest is not cryptographic: whoever can write the bytes can write
matching digests too; the authenticated rendezvous keeps strangers off the wire.

Per bucket, `BucketDigests.of(k, buf)` is one small `int64[pieces, 2]`
tensor: the digest `[A, B]` of each piece of bucket `k` (a whole tensor, or
the byte range of a split one), positions counted from the piece's own
first word, as it lies in `buf`. With windows of `n` words (`WINDOW_WORDS`
on CPU, `DEVICE_WINDOW_WORDS` on an accelerator; the lanes do not depend on
it), pieces of at least `n` words are summed in chunks of `n` (chunk `q`'s
sums scaled by `(KA, KB)**(q * n)`), and smaller ones batched in windows of the
bucket: the window's weighted terms are summed per block of `BLOCK_WORDS`
(every piece starts a block), prefix sums of the block sums less the few
words after a piece's end in its last block give each piece's sums, and
these are rescaled from the window's first word to the piece's own by
`(KA, KB)**-begin` (odd numbers are invertible modulo 2**64). So a bucket of
thousands of small tensors costs a few torch calls per window, not per tensor.

Cost: per chunk or window the terms take two widening copies (the words,
their mixes), four int32 passes (the mix), one int64 multiply by the
position weights and one sum: about 120 bytes of memory traffic per 4-byte
word, and int64 multiplies are the slowest part on CPU. A fused kernel would
read each word once and keep its terms in registers.

Worker: `BucketDigests.check(k, buf, expected)` raises `DigestMismatch`
naming the bucket and the first parameter whose bytes differ; core's
`LoadPipeline.received` runs it before the bucket's load, so nothing of a
corrupt bucket is loaded and the round fails (the engine rolls back).

`DigestRoom` is where a fixed staging buffer keeps its bucket's digests (the
`ipc` wire): the tail of every buffer, after at most `max_pieces` pieces of
bucket bytes; both ends derive it from the buffer size.

`bucket_landed(k, buf)`: a receiver calls it right after bucket `k`'s bytes
landed in `buf`, before any check (`LoadPipeline.received` does). It is the one
point where fault injection (`weight_transfer.testing.seams`) sees the bytes on
their way; without an injector installed it does nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weight_transfer.runtime.phases import timed
from wt_kits.stream.packing import ALIGNMENT, Bucket, BucketPlan, as_bytes

__all__ = [
    "digest",
    "BucketDigests",
    "DigestMismatch",
    "DigestRoom",
    "bucket_landed",
    "DIGEST_DTYPE",
]

DIGEST_DTYPE = torch.int64
WINDOW_WORDS = 1 << 16  # words per torch call on CPU (int64 rows of 512 KiB: in L2)
DEVICE_WINDOW_WORDS = 1 << 21  # on an accelerator, where every call is a kernel launch
BLOCK_WORDS = ALIGNMENT // 4  # a window's terms are summed per block; pieces start on one

KA = 0x9E3779B97F4A7C15  # lane A's position base (odd, 5 mod 8)
KB = 0x94D049BB133111EB  # lane B's position base (odd, 3 mod 8)
MIX = 0x9E3779B1  # lane B's 32-bit word multiplier (odd)
_MOD = 1 << 64


def _window_words(device: torch.device) -> int:
    """Words per torch call on `device` (the lanes do not depend on it)."""
    return WINDOW_WORDS if device.type == "cpu" else DEVICE_WINDOW_WORDS


# Fault injectors, `hook(bucket_index, received_bytes)`: installed only by
# `weight_transfer.testing.seams`.
_LANDED: list[Callable[[int, torch.Tensor], None]] = []


def bucket_landed(k: int, buf: torch.Tensor) -> None:
    """Bucket `k`'s bytes landed in `buf` and are not checked yet (see the module doc)."""
    for hook in list(_LANDED):
        hook(k, buf)


class DigestMismatch(RuntimeError):
    """A received piece differs from what the trainer sent; names the bucket and parameter."""

    def __init__(self, message: str, *, bucket: int, param: str) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.param = param


def _signed(value: int) -> int:
    """`value` modulo 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    value %= _MOD
    return value - _MOD if value >> 63 else value


def _signed32(value: int) -> int:
    """`value` modulo 2**32 as a signed 32-bit integer (what an int32 tensor holds)."""
    value %= 1 << 32
    return value - (1 << 32) if value >> 31 else value


def _powers(exponent: int) -> tuple[int, int]:
    """`(KA**exponent, KB**exponent)` modulo 2**64, signed; a negative exponent inverts."""
    return _signed(pow(KA, exponent, _MOD)), _signed(pow(KB, exponent, _MOD))


def _mix(words: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`out` set to `mix(words)` (module docstring); all three int32 of one size."""
    torch.mul(words, _signed32(MIX), out=out)
    high = torch.bitwise_right_shift(out, 16, out=scratch).bitwise_and_(0xFFFF)
    return out.bitwise_xor_(high)


def _words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`data` (flat uint8) as its int32 words and its tail bytes (a copy if misaligned)."""
    whole = data.numel() // 4 * 4
    body = data[:whole]
    if body.storage_offset() % 4:
        body = body.clone()
    return body.view(torch.int32), data[whole:]


@functools.lru_cache(maxsize=8)
def _power_table(n: int, sign: int = 1) -> torch.Tensor:
    """`int64[2, n]` on the CPU: `(KA, KB)**(sign * l)` for `l < n`, by repeated doubling."""
    powers = torch.ones(2, n, dtype=DIGEST_DTYPE)
    have = 1
    while have < n:
        for lane, power in enumerate(_powers(sign * have)):
            powers[lane, have : 2 * have] = powers[lane, : min(have, n - have)] * power
        have *= 2
    return powers


def _powers_of(exponents: list[int], n: int, sign: int = 1) -> list[tuple[int, int]]:
    """`(KA, KB)**(sign * e)` for each `e` of `exponents`: from the table of `n` powers
    where it holds them (a layout of thousands of pieces needs thousands of powers)."""
    table = _power_table(n, sign)
    found = iter(table[:, [e for e in exponents if 0 <= e < n]].t().tolist())
    return [tuple(next(found)) if 0 <= e < n else _powers(sign * e) for e in exponents]


class _Tables:
    """Per device and window size `n`: the position weights `KA**l`, `KB**l` for `l < n`
    and the step `(KA, KB)**n` from one chunk to the next. Read-only, copied from the
    CPU's table, so every device holds the same values."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[torch.device, int], dict[str, torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> dict[str, torch.Tensor]:
        if (device, n) not in self.by_key:
            self.by_key[device, n] = {
                "weights": _power_table(n).to(device),
                "step": torch.tensor(_powers(n), dtype=DIGEST_DTYPE, device=device),
            }
        return self.by_key[device, n]


_TABLES = _Tables()


class _Scratch(threading.local):
    """Per thread, device and window size: work buffers, allocated once (fresh
    buffers per call page-fault on CPU). Per thread, because a trainer and a worker
    may digest in one process at once."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[torch.device, int], dict[str, torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> dict[str, torch.Tensor]:
        if (device, n) not in self.by_key:
            self.by_key[device, n] = {
                "terms": torch.empty(2, n, dtype=DIGEST_DTYPE, device=device),
                "mixed": torch.empty(n, dtype=torch.int32, device=device),
                "high": torch.empty(n, dtype=torch.int32, device=device),
                "prefix": torch.zeros(2, n // BLOCK_WORDS + 1, dtype=DIGEST_DTYPE, device=device),
            }
        return self.by_key[device, n]


_SCRATCH = _Scratch()


def _terms(words: torch.Tensor, padded: int, window: int) -> torch.Tensor:
    """`int64[2, padded]`: lane A's and lane B's terms of `words` (int32, at most
    `window`), weighted by their position in `words`; zero terms after them."""
    device = words.device
    scratch, weights = _SCRATCH.get(device, window), _TABLES.get(device, window)["weights"]
    n = words.numel()
    terms = scratch["terms"][:, :padded]
    terms[0, :n].copy_(words)
    terms[1, :n].copy_(_mix(words, scratch["mixed"][:n], scratch["high"][:n]))
    if padded > n:
        terms[:, n:].zero_()  # zero words have zero terms in both lanes
    return terms.mul_(weights[:, :padded])


def _sum_chunks_into(out: torch.Tensor, words: torch.Tensor) -> None:
    """Add into `out` (int64[2]) the lanes of `words` (int32), positions from its first."""
    if not words.numel():
        return
    window = _window_words(words.device)
    step = _TABLES.get(words.device, window)["step"]
    scale = torch.ones(2, dtype=DIGEST_DTYPE, device=words.device)
    for start in range(0, words.numel(), window):
        if start:
            scale.mul_(step)
        chunk = words[start : start + window]
        out.add_(_terms(chunk, chunk.numel(), window).sum(1).mul_(scale))


def _tail_lanes(tail_words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int64[tails, 2]`: the lanes of tail words (int32) at positions whose weights
    are `scales` (`int64[tails, 2]`)."""
    mixed = _mix(tail_words, torch.empty_like(tail_words), torch.empty_like(tail_words))
    return torch.stack((tail_words, mixed), dim=1).to(DIGEST_DTYPE).mul_(scales)


def digest(data: torch.Tensor) -> torch.Tensor:
    """The digest `int64[A, B]` of `data`'s bytes, on `data`'s device (module docstring)."""
    flat = as_bytes(data)
    out = torch.zeros(2, dtype=DIGEST_DTYPE, device=flat.device)
    words, tail = _words(flat)
    _sum_chunks_into(out, words)
    if tail.numel():
        shifts = torch.tensor([1, 1 << 8, 1 << 16][: tail.numel()], device=flat.device)
        word = (tail * shifts).sum().reshape(1).to(torch.int32)
        scale = torch.tensor([_powers(words.numel())], dtype=DIGEST_DTYPE, device=flat.device)
        out.add_(_tail_lanes(word, scale)[0])
    return out


@dataclass(frozen=True)
class _Window:
    """Small pieces lying in words `[start, stop)` of a bucket, batched in one pass."""

    start: int
    stop: int
    rows: list[int]  # the pieces' indexes in the bucket
    first_block: list[int]  # per piece: the block it starts (blocks counted from `start`)
    end_block: list[int]  # per piece: one past the block holding its last word
    unshift: list[tuple[int, int]]  # per piece: (KA, KB)**-(its first word - start)
    edge_piece: list[int]  # per word after a piece in its last block: the piece's slot
    edge_at: list[int]  # ... and that word, relative to `start`

    @property
    def padded(self) -> int:
        return -(-(self.stop - self.start) // BLOCK_WORDS) * BLOCK_WORDS


@dataclass(frozen=True)
class _Layout:
    """How one bucket's digests are computed: large pieces, windows, tail words."""

    large: list[tuple[int, int, int]]  # (piece, first word, words)
    windows: list[_Window]
    tail_rows: list[int]  # per piece with a tail word: the piece
    tail_scale: list[tuple[int, int]]  # ... and (KA, KB)**(its tail word's position)
    tail_slot: list[int]  # per tail byte: its piece's slot in `tail_rows`
    tail_at: list[int]  # ... its offset in the bucket
    tail_shift: list[int]  # ... its place value in the tail word (1, 2**8, 2**16)


def _window(rows: list[int], spans: list[tuple[int, int]], n: int) -> _Window:
    """The window (of at most `n` words) of small pieces `rows` lying in bucket words
    `spans`, each starting on a block boundary."""
    start, stop = spans[0][0], spans[-1][1]
    first_block: list[int] = []
    end_block: list[int] = []
    edge_piece: list[int] = []
    edge_at: list[int] = []
    for slot, (begin, end) in enumerate(spans):
        end_block.append(-(-(end - start) // BLOCK_WORDS))
        first_block.append((begin - start) // BLOCK_WORDS)
        past = min(end_block[-1] * BLOCK_WORDS, stop - start)  # words after the window are 0
        edge_piece += [slot] * (past - (end - start))
        edge_at += range(end - start, past)
    unshift = _powers_of([begin - start for begin, _ in spans], n, sign=-1)
    return _Window(start, stop, list(rows), first_block, end_block, unshift, edge_piece, edge_at)


def _layout(bucket: Bucket, window: int) -> _Layout:
    """Bucket `bucket`'s layout for windows of `window` words: pieces of at least that
    many words are summed on their own, smaller ones batched in windows."""
    large: list[tuple[int, int, int]] = []
    windows: list[_Window] = []
    tail_rows: list[int] = []
    tail_scale: list[int] = []
    tail_slot: list[int] = []
    tail_at: list[int] = []
    tail_shift: list[int] = []
    rows: list[int] = []
    spans: list[tuple[int, int]] = []

    def flush() -> None:
        if rows:
            windows.append(_window(rows, spans, window))
        rows.clear()
        spans.clear()

    for j, piece in enumerate(bucket.pieces):
        if piece.offset % ALIGNMENT:
            raise ValueError(
                f"piece {j} starts at byte {piece.offset}, not on a multiple of {ALIGNMENT}"
            )
        first, count = piece.offset // 4, piece.nbytes // 4
        if piece.nbytes % 4:
            for b in range(piece.nbytes % 4):
                tail_slot.append(len(tail_rows))
                tail_at.append(piece.offset + 4 * count + b)
                tail_shift.append(1 << (8 * b))
            tail_rows.append(j)
            tail_scale.append(count)  # its tail word's position
        if count >= window:
            large.append((j, first, count))
            continue
        if count == 0:
            continue
        if rows and first + count - spans[0][0] > window:
            flush()
        rows.append(j)
        spans.append((first, first + count))
    flush()
    scales = _powers_of(tail_scale, window)
    return _Layout(large, windows, tail_rows, scales, tail_slot, tail_at, tail_shift)


def _window_sums(
    window: _Window, words: torch.Tensor, index: dict[str, torch.Tensor], size: int
) -> torch.Tensor:
    """`int64[pieces, 2]`: the lanes of each piece of `window` (`index`: its tensors),
    in windows of `size` words."""
    padded = window.padded
    blocks = padded // BLOCK_WORDS
    prefix = _SCRATCH.get(words.device, size)["prefix"][:, : blocks + 1]  # [:, 0] stays 0
    terms = _terms(words[window.start : window.stop], padded, size)
    torch.cumsum(terms.view(2, blocks, BLOCK_WORDS).sum(2), 1, out=prefix[:, 1:])
    sums = prefix[:, index["end_block"]] - prefix[:, index["first_block"]]
    if window.edge_at:
        sums.index_add_(1, index["edge_piece"], terms[:, index["edge_at"]], alpha=-1)
    return sums.t().mul_(index["unshift"])


class BucketDigests:
    """The digests of a plan's buckets (module docstring); per-bucket layouts built on first use."""

    def __init__(self, plan: BucketPlan) -> None:
        self.plan = plan
        self._layouts: dict[tuple[int, int], _Layout] = {}
        self._indexes: dict[tuple[int, torch.device, int], list[dict[str, torch.Tensor]]] = {}

    @classmethod
    def of_plan(cls, plan: BucketPlan) -> BucketDigests:
        """The plan's own instance (kept in `plan.derived`), so layouts are built once
        for as long as a trainer reuses its plan (`PlanCache`)."""
        found = plan.derived.get("digests")
        if not isinstance(found, BucketDigests):
            found = plan.derived["digests"] = cls(plan)
        return found

    def _layout(self, k: int, window: int) -> _Layout:
        if (k, window) not in self._layouts:
            self._layouts[k, window] = _layout(self.plan.buckets[k], window)
        return self._layouts[k, window]

    def _index(self, k: int, device: torch.device, window: int) -> list[dict[str, torch.Tensor]]:
        """Bucket `k`'s layout as tensors on `device`: the tails', then each window's."""
        key = (k, device, window)
        if key not in self._indexes:
            layout = self._layout(k, window)

            def tensor(values: Sequence[object]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            tails = {
                "rows": tensor(layout.tail_rows),
                "scale": tensor(layout.tail_scale),
                "slot": tensor(layout.tail_slot),
                "at": tensor(layout.tail_at),
                "shift": tensor(layout.tail_shift).to(torch.int32),
            }
            windows = [
                {
                    "rows": tensor(w.rows),
                    "first_block": tensor(w.first_block),
                    "end_block": tensor(w.end_block),
                    "unshift": tensor(w.unshift),
                    "edge_piece": tensor(w.edge_piece),
                    "edge_at": tensor(w.edge_at),
                }
                for w in layout.windows
            ]
            self._indexes[key] = [tails, *windows]
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
        size = _window_words(buf.device)
        layout = self._layout(k, size)
        tails, *windows = self._index(k, buf.device, size)
        out = torch.zeros(len(bucket.pieces), 2, dtype=DIGEST_DTYPE, device=buf.device)
        words, _ = _words(buf)
        for j, first, count in layout.large:
            _sum_chunks_into(out[j], words[first : first + count])
        for window, index in zip(layout.windows, windows, strict=True):
            out.index_copy_(0, index["rows"], _window_sums(window, words, index, size))
        if layout.tail_rows:
            tail_words = torch.zeros(len(layout.tail_rows), dtype=torch.int32, device=buf.device)
            tail_bytes = buf[tails["at"]].to(torch.int32) * tails["shift"]
            tail_words.index_add_(0, tails["slot"], tail_bytes)
            out.index_add_(0, tails["rows"], _tail_lanes(tail_words, tails["scale"]))
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
        with timed("verify"):
            mine = self.of(k, buf)
            expected = expected.to(mine.device)
            same = torch.equal(mine, expected)
        if same:
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
