"""Verified bytes: a digest of every piece a bucketed wire moves, and the worker's check.

The digest of a run of bytes is a pair of 64-bit lanes computed with torch
ops on the bytes' own device (CPU or CUDA; nothing is copied to the host),
in two stages.

1. **Block sums.** The bytes, read as signed 8-bit integers and zero-padded
   to a multiple of `BLOCK_BYTES` (64, the bucket alignment, so every piece
   of a bucket starts a block), form blocks `b` of 64. Each block gives two
   sums `b @ M`, where `M` (`BLOCK_WEIGHTS`) is a fixed `int8[64, 2]` matrix
   of nonzero entries, no two rows proportional. Every sum is an exact
   integer under 2**20: nothing wraps, so every bit of every byte counts
   alike, and the order of the additions never matters (CPU and CUDA agree).
   One int8 matrix product reads the bytes once.
2. **Lanes.** Each block's two sums, as 32-bit patterns (the first low, the
   second high), are one signed 64-bit word `w_b`. With arithmetic modulo
   2**64:

       A = sum(KA**b * w_b)
       B = sum(KB**b * mix(w_b)),  mix(x) = u ^ (u >> 32), u = MIX * x

   where `KA`, `KB` and `MIX` are fixed odd 64-bit constants and `>>` is a
   logical shift. Lane A weighs each word by a power of `KA`; lane B first
   mixes each word non-linearly (`mix` is a bijection that brings the high
   bits of the product down into the low ones) and weighs it by a power of
   `KB`. Products and sums wrap alike in torch on CPU and CUDA.

Stage 2 reads one word per 64 bytes, so the digest costs about 1.3-1.7
copies of the bytes on one CPU core (stage 1 about one; `wt_tools.digest_bench`),
where lanes over the bytes themselves cost 9-11.

What it detects, for pieces under 2**41 blocks:

- **Within a block**, a change `d` of its bytes (`d_k` the change of byte
  `k` read as signed, `0 < |d_k| < 256`) changes the block's sums unless
  `d @ M = 0`, two equations over the integers. One or two changed bytes
  always change them (entries nonzero, rows not proportional), whatever
  their bits: a flipped sign bit is a change of 128 like any other. Three or
  more bytes can cancel: a change of `k` bytes of one block drawn at random
  does so with probability about `1 / (2 pi s_0 s_1)`, `s_c**2 = sum(d_k**2
  * M[k, c]**2)`: about 2**-17 for +-1 on four bytes, 2**-31 for four bytes
  drawn at random. This is the price of reading the bytes once.
- **Across blocks**, changed sums are changed words, by `d` with `v(d) <= 52`
  (`v(n)`: the number of factors 2 in `n`; each sum changes by less than
  2**21, and `v(d) <= 20` when the first one changes). A lane's change is
  nonzero when its factors 2 number fewer than 64:
  - every change of one block: lane A changes by `KA**b * d`, `KA` odd; lane
    B alike, `mix` being a bijection;
  - every pair `(+d, +d)` at any distance `s`: lane A changes by
    `KA**b * d * (1 + KA**s)`, `v(1 + KA**s) = 1`;
  - every pair `(+d, -d)`, so every exchange of two blocks, at distance `s`:
    lane A changes by `KA**b * d * (1 - KA**s)`, `v(1 - KA**s) = 2 + v(s)`
    (`KA = 5 mod 8`): nonzero when the blocks' first sums differ, or when
    `v(s) < 10`;
  - `(+c, -2c, +c)` on three consecutive words and `(+c, -c, -c, +c)` on
    four: lane A changes by `KA**b * c * (1 - KA)**2` and
    `KA**b * c * (1 - KA)(1 - KA**2)`, 4 and 5 factors 2.

  A change of words that lane A misses solves `sum(KA**b * d_b) = 0 mod
  2**64`: long patterns exist (+-1 on 2**10 words in Thue-Morse order), but
  it still has to cancel lane B, whose terms depend non-linearly on the
  words' values; we know of no small pattern that cancels both.

The digest is not cryptographic: whoever can write the bytes can write
matching digests too; the authenticated rendezvous keeps strangers off the
wire.

Per bucket, `BucketDigests.of(k, buf)` is one small `int64[pieces, 2]`
tensor: the digest `[A, B]` of each piece of bucket `k` (a whole tensor, or
the byte range of a split one), as it lies in `buf`. Stage 1 runs once over
the bucket's whole blocks; the last block of a piece that does not fill it
(its tail, followed by padding) is summed again from the piece's own bytes,
zero-padded, all such blocks of a bucket in one product. In stage 2 every
piece is a run of whole words, the runs gapless. With windows of `n` words
(`WINDOW_WORDS` on CPU, `DEVICE_WINDOW_WORDS` on an accelerator; the lanes
do not depend on it), runs of at least `n` words are summed in chunks of `n`
(chunk `q`'s sums scaled by `(KA, KB)**(q * n)`), and shorter ones batched
in windows: prefix sums of the window's weighted terms give each run's sums,
rescaled from the window's first word to the run's own by `(KA, KB)**-begin`
(odd numbers are invertible modulo 2**64). So a bucket of thousands of small
tensors costs a few torch calls per window, not per tensor.

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
    "BLOCK_BYTES",
    "BLOCK_WEIGHTS",
    "DIGEST_DTYPE",
]

DIGEST_DTYPE = torch.int64
BLOCK_BYTES = ALIGNMENT  # bytes per block of stage 1; every piece of a bucket starts one
SUMS = 2  # sums per block, together one 64-bit word of stage 2
WINDOW_WORDS = 1 << 16  # stage 2's words per torch call on CPU (int64 rows of 512 KiB: in L2)
DEVICE_WINDOW_WORDS = 1 << 21  # on an accelerator, where every call is a kernel launch
EXACT_ROWS = 1 << 16  # blocks per float64 product off the CPU (32 MiB of float64)
KEPT_SUM_BLOCKS = 1 << 20  # block sums kept between buckets (8 MiB: buckets up to 64 MiB)

KA = 0x9E3779B97F4A7C15  # lane A's position base (odd, 5 mod 8)
KB = 0x94D049BB133111EB  # lane B's position base (odd, 3 mod 8)
MIX = 0xD6E8FEB86659FD93  # lane B's word multiplier (odd)
_MOD = 1 << 64


def _draw_block_weights() -> torch.Tensor:
    """`int8[BLOCK_BYTES, SUMS]`, row by row: entries `x mod 255 - 127` of splitmix64
    draws from state 0, a zero skipped, a row proportional to an earlier one drawn again."""
    state = 0

    def draw() -> int:
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) % _MOD
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) % _MOD
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _MOD
        return z ^ (z >> 31)

    rows: list[list[int]] = []
    while len(rows) < BLOCK_BYTES:
        row: list[int] = []
        while len(row) < SUMS:
            value = draw() % 255 - 127
            if value:
                row.append(value)
        if all(row[0] * other[1] != row[1] * other[0] for other in rows):
            rows.append(row)
    return torch.tensor(rows, dtype=torch.int8)


BLOCK_WEIGHTS = _draw_block_weights()


def _window_words(device: torch.device) -> int:
    """Stage 2's words per torch call on `device` (the lanes do not depend on it)."""
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


def _powers(exponent: int) -> tuple[int, int]:
    """`(KA**exponent, KB**exponent)` modulo 2**64, signed; a negative exponent inverts."""
    return _signed(pow(KA, exponent, _MOD)), _signed(pow(KB, exponent, _MOD))


# -- stage 1: block sums -------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _weights_on(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`BLOCK_WEIGHTS` on `device` as `dtype` (read-only)."""
    return BLOCK_WEIGHTS.to(device, dtype)


def _int8_sums(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """`out` (int32[m, SUMS]) set to `blocks @ BLOCK_WEIGHTS` (`blocks`: int8[m,
    BLOCK_BYTES]) by one int8 product with int32 sums: how the CPU computes them."""
    torch._int_mm(blocks, _weights_on(blocks.device, torch.int8), out=out)


def _float_sums(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """`_int8_sums` by float64 products, `EXACT_ROWS` blocks at a time: exact, every
    product and partial sum being an integer under 2**20; how other devices compute them."""
    weights = _weights_on(blocks.device, torch.float64)
    for start in range(0, blocks.shape[0], EXACT_ROWS):
        part = blocks[start : start + EXACT_ROWS]
        out[start : start + part.shape[0]].copy_(torch.mm(part.to(torch.float64), weights))


def _block_sums(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """`out` (int32[m, SUMS]) set to the sums of `blocks` (int8[m, BLOCK_BYTES])."""
    if blocks.shape[0]:
        (_int8_sums if blocks.device.type == "cpu" else _float_sums)(blocks, out)


def _as_blocks(flat: torch.Tensor) -> torch.Tensor:
    """`flat` (uint8, a multiple of `BLOCK_BYTES` long) as `int8[blocks, BLOCK_BYTES]`."""
    return flat.view(torch.int8).view(-1, BLOCK_BYTES)


def _sums_of(flat: torch.Tensor) -> torch.Tensor:
    """Stage 2's words (int64, one per block): the block sums of `flat` (uint8), its
    last block zero-padded."""
    whole = flat.numel() // BLOCK_BYTES * BLOCK_BYTES
    blocks = -(-flat.numel() // BLOCK_BYTES)
    sums = torch.empty(blocks, SUMS, dtype=torch.int32, device=flat.device)
    _block_sums(_as_blocks(flat[:whole]), sums[: whole // BLOCK_BYTES])
    if whole < flat.numel():
        last = torch.zeros(1, BLOCK_BYTES, dtype=torch.int8, device=flat.device)
        last[0, : flat.numel() - whole] = flat[whole:].view(torch.int8)
        _block_sums(last, sums[-1:])
    return sums.view(torch.int64).view(-1)


# -- stage 2: lanes ------------------------------------------------------------------


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
    """Per thread and device: work buffers, allocated once and grown (fresh buffers
    per call page-fault on CPU). Per thread, because a trainer and a worker may
    digest in one process at once."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[torch.device, int], dict[str, torch.Tensor]] = {}
        self.block_sums: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> dict[str, torch.Tensor]:
        """Stage 2's buffers for windows of `n` words."""
        if (device, n) not in self.by_key:
            self.by_key[device, n] = {
                "terms": torch.empty(2, n, dtype=DIGEST_DTYPE, device=device),
                "mixed": torch.empty(n, dtype=DIGEST_DTYPE, device=device),
                "high": torch.empty(n, dtype=DIGEST_DTYPE, device=device),
                "prefix": torch.zeros(2, n + 1, dtype=DIGEST_DTYPE, device=device),
            }
        return self.by_key[device, n]

    def sums(self, device: torch.device, blocks: int) -> torch.Tensor:
        """`int32[blocks, SUMS]`: room for a bucket's block sums, kept for the next
        bucket up to `KEPT_SUM_BLOCKS` blocks (a larger one, such as a one-tensor
        bucket of a large embedding, gets room of its own, freed after it)."""
        if blocks > KEPT_SUM_BLOCKS:
            return torch.empty(blocks, SUMS, dtype=torch.int32, device=device)
        have = self.block_sums.get(device)
        if have is None or have.shape[0] < blocks:
            have = self.block_sums[device] = torch.empty(
                blocks, SUMS, dtype=torch.int32, device=device
            )
        return have[:blocks]


_SCRATCH = _Scratch()


def _mix(words: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`out` set to `mix(words)` (module docstring); all three int64 of one size."""
    torch.mul(words, _signed(MIX), out=out)
    high = torch.bitwise_right_shift(out, 32, out=scratch).bitwise_and_(0xFFFFFFFF)
    return out.bitwise_xor_(high)


def _weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`sum(values * weights)` modulo 2**64 (int64, one dimension): one pass on the CPU."""
    if values.device.type == "cpu":
        return torch.dot(values, weights)
    return torch.mul(values, weights).sum()


def _terms(words: torch.Tensor, window: int) -> torch.Tensor:
    """`int64[2, len(words)]`: lane A's and lane B's terms of `words` (int64, at most
    `window`), weighted by their position in `words`."""
    device = words.device
    scratch, weights = _SCRATCH.get(device, window), _TABLES.get(device, window)["weights"]
    n = words.numel()
    terms = scratch["terms"][:, :n]
    torch.mul(words, weights[0, :n], out=terms[0])
    torch.mul(_mix(words, scratch["mixed"][:n], scratch["high"][:n]), weights[1, :n], out=terms[1])
    return terms


def _sum_chunks_into(out: torch.Tensor, words: torch.Tensor) -> None:
    """Add into `out` (int64[2]) the lanes of `words` (int64), positions from its first."""
    if not words.numel():
        return
    window = _window_words(words.device)
    scratch, tables = _SCRATCH.get(words.device, window), _TABLES.get(words.device, window)
    weights = tables["weights"]
    scale = torch.ones(2, dtype=DIGEST_DTYPE, device=words.device)
    for start in range(0, words.numel(), window):
        if start:
            scale.mul_(tables["step"])
        chunk = words[start : start + window]
        n = chunk.numel()
        mixed = _mix(chunk, scratch["mixed"][:n], scratch["high"][:n])
        lanes = torch.stack(
            (_weighted_sum(chunk, weights[0, :n]), _weighted_sum(mixed, weights[1, :n]))
        )
        out.add_(lanes.mul_(scale))


def digest(data: torch.Tensor) -> torch.Tensor:
    """The digest `int64[A, B]` of `data`'s bytes, on `data`'s device (module docstring)."""
    flat = as_bytes(data)
    out = torch.zeros(2, dtype=DIGEST_DTYPE, device=flat.device)
    _sum_chunks_into(out, _sums_of(flat))
    return out


# -- per bucket ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Window:
    """Pieces whose words (stage 2's) lie in `[start, stop)`, summed in one pass."""

    start: int
    stop: int
    rows: list[int]  # the pieces' indexes in the bucket
    begin: list[int]  # per piece: its first word, relative to `start`
    end: list[int]  # ... one past its last
    unshift: list[tuple[int, int]]  # ... (KA, KB)**-begin


@dataclass(frozen=True)
class _Layout:
    """How one bucket's digests are computed: its blocks, the blocks its pieces'
    tails share with padding, its large pieces and its windows of small ones."""

    blocks: int  # blocks of the bucket's bytes, the last one possibly partial
    tail_block: list[int]  # per piece that ends inside a block: that block
    tail_from: list[int]  # per tail byte: its offset in the bucket
    tail_to: list[int]  # ... and its place in the tails' zero-padded blocks
    large: list[tuple[int, int, int]]  # (piece, first word, words)
    windows: list[_Window]


def _layout(bucket: Bucket, window: int) -> _Layout:
    """Bucket `bucket`'s layout for windows of `window` words: pieces of at least that
    many words are summed on their own, smaller ones batched in windows."""
    tail_block: list[int] = []
    tail_from: list[int] = []
    tail_to: list[int] = []
    large: list[tuple[int, int, int]] = []
    windows: list[_Window] = []
    rows: list[int] = []
    spans: list[tuple[int, int]] = []

    def flush() -> None:
        if rows:
            start = spans[0][0]
            begin = [b - start for b, _ in spans]
            unshift = _powers_of(begin, window, sign=-1)
            end = [e - start for _, e in spans]
            windows.append(_Window(start, spans[-1][1], list(rows), begin, end, unshift))
        rows.clear()
        spans.clear()

    for j, piece in enumerate(bucket.pieces):
        if piece.offset % BLOCK_BYTES:
            raise ValueError(
                f"piece {j} starts at byte {piece.offset}, not on a multiple of {BLOCK_BYTES}"
            )
        first_block = piece.offset // BLOCK_BYTES
        end_block = -(-(piece.offset + piece.nbytes) // BLOCK_BYTES)
        spare = piece.nbytes % BLOCK_BYTES
        if spare:
            last = end_block - 1
            tail_to += range(len(tail_block) * BLOCK_BYTES, len(tail_block) * BLOCK_BYTES + spare)
            tail_from += range(last * BLOCK_BYTES, last * BLOCK_BYTES + spare)
            tail_block.append(last)
        first, count = first_block, end_block - first_block
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
    blocks = -(-bucket.nbytes // BLOCK_BYTES)
    return _Layout(blocks, tail_block, tail_from, tail_to, large, windows)


def _window_sums(
    window: _Window, words: torch.Tensor, index: dict[str, torch.Tensor], size: int
) -> torch.Tensor:
    """`int64[pieces, 2]`: the lanes of each piece of `window` (`index`: its tensors),
    in windows of `size` words."""
    n = window.stop - window.start
    prefix = _SCRATCH.get(words.device, size)["prefix"][:, : n + 1]  # [:, 0] stays 0
    torch.cumsum(_terms(words[window.start : window.stop], size), 1, out=prefix[:, 1:])
    sums = prefix[:, index["end"]] - prefix[:, index["begin"]]
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
                "block": tensor(layout.tail_block),
                "from": tensor(layout.tail_from),
                "to": tensor(layout.tail_to),
            }
            windows = [
                {
                    "rows": tensor(w.rows),
                    "begin": tensor(w.begin),
                    "end": tensor(w.end),
                    "unshift": tensor(w.unshift),
                }
                for w in layout.windows
            ]
            self._indexes[key] = [tails, *windows]
        return self._indexes[key]

    @staticmethod
    def _sums(buf: torch.Tensor, layout: _Layout, tails: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stage 2's words of a bucket (`buf`: its bytes): one product over its whole
        blocks, one more over its pieces' tails, each zero-padded to a block."""
        sums = _SCRATCH.sums(buf.device, layout.blocks)
        whole = buf.numel() // BLOCK_BYTES
        _block_sums(_as_blocks(buf[: whole * BLOCK_BYTES]), sums[:whole])
        if layout.tail_block:
            count = len(layout.tail_block)
            padded = torch.zeros(count * BLOCK_BYTES, dtype=torch.int8, device=buf.device)
            padded.index_copy_(0, tails["to"], buf.view(torch.int8).index_select(0, tails["from"]))
            tail_sums = torch.empty(count, SUMS, dtype=torch.int32, device=buf.device)
            _block_sums(padded.view(count, BLOCK_BYTES), tail_sums)
            sums.index_copy_(0, tails["block"], tail_sums)
        return sums.view(torch.int64).view(-1)

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
        words = self._sums(buf, layout, tails)
        out = torch.zeros(len(bucket.pieces), 2, dtype=DIGEST_DTYPE, device=buf.device)
        for j, first, count in layout.large:
            _sum_chunks_into(out[j], words[first : first + count])
        for window, index in zip(layout.windows, windows, strict=True):
            out.index_copy_(0, index["rows"], _window_sums(window, words, index, size))
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
