"""Verified bytes on their own: the digest, per-bucket digests, the digest room, and the
pipeline's check before a load (`wt_kits.stream.digests`, `LoadPipeline.received`).

The detection tests change a bucket's 32-bit words by crafted and by random small patterns
(the kind a plain weighted sum of the words misses) and require both lanes of every changed
piece's digest to change; the lanes' own tests change stage 2's words directly."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from weight_transfer.backend import ParamMeta
from weight_transfer.testing.seams import on_bucket_landed
from wt_kits.stream import LoadFailed, LoadPipeline, Unpacker, as_bytes, plan_buckets
from wt_kits.stream import digests as digest_module
from wt_kits.stream.digests import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    SUMS,
    WINDOW_WORDS,
    BucketDigests,
    DigestMismatch,
    DigestRoom,
    digest,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]

MOD = 1 << 64
CHUNK_BYTES = WINDOW_WORDS * BLOCK_BYTES  # the bytes behind one chunk of stage 2 (a word a block)
CHUNK_DATA_WORDS = CHUNK_BYTES // 4


def _signed(x: int) -> int:
    return (x + 2**63) % MOD - 2**63


def _mix(x: int) -> int:
    u = x * digest_module.MIX % MOD
    return _signed(u ^ (u >> 32))


def reference_lanes(words: Sequence[int]) -> list[int]:
    """Stage 2 as documented, in Python integers: lanes A and B of the signed 64-bit
    `words`, modulo 2**64 as signed int64."""
    a = b = 0
    pa = pb = 1
    for w in words:
        a = (a + pa * w) % MOD
        b = (b + pb * _mix(w)) % MOD
        pa, pb = pa * digest_module.KA % MOD, pb * digest_module.KB % MOD
    return [_signed(s) for s in (a, b)]


def reference_words(data: bytes) -> list[int]:
    """Stage 1 as documented: the signed bytes, zero-padded to whole blocks, times the
    block weights (numpy's int64 product: exact); each block's two sums, as 32-bit
    patterns low then high, one signed 64-bit word."""
    padded = data + bytes(-len(data) % BLOCK_BYTES)
    blocks = np.frombuffer(padded, dtype=np.int8).astype(np.int64).reshape(-1, BLOCK_BYTES)
    sums = (blocks @ BLOCK_WEIGHTS.numpy().astype(np.int64)).tolist()
    return [_signed(s0 % 2**32 + (s1 % 2**32 << 32)) for s0, s1 in sums]


def reference(data: bytes) -> list[int]:
    """The documented digest of `data`: the lanes of its blocks' words."""
    return reference_lanes(reference_words(data))


def lanes(words: torch.Tensor) -> torch.Tensor:
    """Stage 2 alone (int64 `words`), as the module computes it."""
    out = torch.zeros(2, dtype=torch.int64)
    digest_module._sum_chunks_into(out, words)
    return out


def random_tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def flipped(data: torch.Tensor, at: int, mask: int) -> torch.Tensor:
    out = as_bytes(data).clone()
    out[at] ^= mask
    return out


def added(words: torch.Tensor, changes: Sequence[tuple[int, int]]) -> None:
    """Add `delta` to int32 word `at` of `words` for each `(at, delta)` (distinct `at`),
    wrapping."""
    at = torch.tensor([a for a, _ in changes], dtype=torch.int64)
    delta = torch.tensor([d for _, d in changes], dtype=torch.int64)
    words[at] = ((words[at].to(torch.int64) + delta + 2**31) % 2**32 - 2**31).to(torch.int32)


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 4, 5, 63, 64, 1001, 300_001])
def test_the_digest_is_the_documented_lanes(nbytes: int) -> None:
    data = random_tensor(torch.uint8, nbytes, seed=nbytes)
    assert digest(data).tolist() == reference(data.numpy().tobytes())


def test_a_piece_longer_than_a_chunk_has_the_documented_lanes() -> None:
    data = random_tensor(torch.uint8, 2 * CHUNK_BYTES + 4003, seed=9)  # two chunks and a tail
    assert digest(data).tolist() == reference(data.numpy().tobytes())
    constant = torch.full((CHUNK_BYTES + 8,), 0x7F, dtype=torch.uint8)
    assert digest(constant).tolist() == reference(constant.numpy().tobytes())


def test_the_block_weights_are_nonzero_and_no_two_rows_proportional() -> None:
    """What makes every change of one or two bytes of a block change its sums."""
    m = BLOCK_WEIGHTS.to(torch.int64)
    assert tuple(m.shape) == (BLOCK_BYTES, SUMS) == (64, 2)
    assert m.ne(0).all()
    cross = m[:, None, 0] * m[None, :, 1] - m[:, None, 1] * m[None, :, 0]
    assert cross.ne(0).sum() == BLOCK_BYTES * (BLOCK_BYTES - 1)  # zero on the diagonal only


def test_every_change_of_one_or_two_bytes_of_a_block_changes_its_sums() -> None:
    """Every pair of places, changes of every size and sign (as signed bytes), at once."""
    m = BLOCK_WEIGHTS.to(torch.int64)
    d = torch.tensor([1, 2, 3, 64, 127, 128, 129, 255])
    d = torch.cat([d, -d])
    for k in range(BLOCK_BYTES):
        one = d[:, None] * m[k]  # [changes, 2]
        assert one.ne(0).any(1).all(), k
        two = one[:, None, None, :] + d[None, :, None, None] * m[None, None, k + 1 :, :]
        assert two.ne(0).any(-1).all(), k


def test_the_int8_and_float64_block_sums_agree_and_are_exact() -> None:
    """The CPU's int8 product and other devices' float64 one give the same integers."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(-128, 128, (2000, BLOCK_BYTES), dtype=torch.int8, generator=g)
    blocks[0] = -128  # the largest sums
    blocks[1] = 127
    exact = blocks.to(torch.int64) @ BLOCK_WEIGHTS.to(torch.int64)
    for sums in (digest_module._int8_sums, digest_module._float_sums):
        out = torch.empty(2000, SUMS, dtype=torch.int32)
        sums(blocks, out)
        assert torch.equal(out.to(torch.int64), exact), sums.__name__
    assert exact.abs().max() < 2**20


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_flipped_byte_changes_the_digest(dtype: torch.dtype) -> None:
    numel = 37 if dtype.itemsize == 1 else 19  # odd byte counts leave tail bytes where possible
    tensor = random_tensor(dtype, numel, seed=3)
    base = digest(tensor)
    assert torch.equal(digest(tensor.clone()), base)  # equal tensors, equal digests
    nbytes = tensor.numel() * dtype.itemsize
    for at in range(nbytes):  # every byte, the tail bytes included
        for mask in (0x01, 0x80, 0xFF):
            assert not torch.equal(digest(flipped(tensor, at, mask)), base), (at, mask)


def test_swapped_words_change_the_digest() -> None:
    words = torch.arange(1, 65, dtype=torch.int32)
    base = digest(words)
    for i, j in [(0, 1), (0, 63), (17, 40)]:
        swapped = words.clone()
        swapped[i], swapped[j] = words[j], words[i]
        assert not torch.equal(digest(swapped), base), (i, j)


# ------------------------------------------- small patterns of changed words, in buckets

# (relative word, delta) patterns; the first five leave both of the old digest's sums
# (sum(w) and sum((i + 1) * w)) unchanged.
CRAFTED = {
    "+1-2+1": [(0, 1), (1, -2), (2, 1)],
    "+1-2+1 at distance 7": [(0, 1), (7, -2), (14, 1)],
    "+1-1-1+1": [(0, 1), (1, -1), (2, -1), (3, 1)],
    "+k-2k+k, large k": [(0, 3 << 28), (1, -(6 << 28)), (2, 3 << 28)],
    "+1-3+3-1": [(0, 1), (1, -3), (2, 3), (3, -1)],
    "+k-k at distance 1": [(0, 5), (1, -5)],
    "+k-k at distance 2": [(0, 1 << 20), (2, -(1 << 20))],
    "+k-k at distance 16": [(0, -77), (16, 77)],
    "+k-k at distance 1000": [(0, 1), (1000, -1)],
    "+k-k at distance 4096": [(0, 1 << 30), (4096, -(1 << 30))],
    "+k+k at distance 3": [(0, 9), (3, 9)],
}


def _word_bucket(seed: int = 0) -> tuple[object, torch.Tensor, list[tuple[int, int]]]:
    """One bucket of float32 pieces of many sizes (windows of small ones, two large ones)
    filled with random bytes, and each piece's (first word, words)."""
    sizes = [3 + 131 * i for i in range(48)] + [CHUNK_DATA_WORDS + 77, 5000, CHUNK_DATA_WORDS]
    metas = [ParamMeta(f"layers.{i // 8}.p{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]
    plan = plan_buckets(metas, buffer_bytes=64 << 20, min_bucket_bytes=64 << 20)
    assert len(plan.buckets) == 1
    bucket = plan.buckets[0]
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (bucket.nbytes,), dtype=torch.uint8, generator=g)
    return plan, buf, [(p.offset // 4, p.nbytes // 4) for p in bucket.pieces]


def _changed_pieces_detected(
    plan: object, buf: torch.Tensor, changes: dict[int, list[tuple[int, int]]]
) -> None:
    """Apply `changes` (piece -> (bucket word, delta)) to a copy of `buf`: both lanes of
    every changed piece's digest differ, and every other piece's digest is unchanged."""
    digests = BucketDigests.of_plan(plan)  # type: ignore[arg-type]
    base = digests.of(0, buf)
    changed = buf.clone()
    words = changed[: changed.numel() // 4 * 4].view(torch.int32)
    added(words, [change for pattern in changes.values() for change in pattern])
    got = digests.of(0, changed)
    for j in range(base.shape[0]):
        lanes_equal = (got[j] == base[j]).tolist()
        if j in changes:
            assert lanes_equal == [False, False], (j, changes[j])
        else:
            assert lanes_equal == [True, True], j


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_multi_word_patterns_change_the_digest_at_every_offset(name: str) -> None:
    pattern = CRAFTED[name]
    span = max(at for at, _ in pattern) + 1
    plan, buf, pieces = _word_bucket()
    for trial in range(24):  # 24 offsets in every piece that holds the pattern
        changes = {}
        for j, (first, count) in enumerate(pieces):
            if count >= span:
                offset = (trial * 7919 + j * 104729) % (count - span + 1)
                if trial < 3:  # the first word, the last, and a block's end
                    offset = [0, count - span, min(15, count - span)][trial]
                changes[j] = [(first + offset + at, delta) for at, delta in pattern]
        _changed_pieces_detected(plan, buf, changes)


@pytest.mark.parametrize("name", ["+1-2+1", "+1-1-1+1", "+k-k at distance 1000"])
def test_crafted_patterns_across_a_chunk_boundary_change_the_digest(name: str) -> None:
    data = random_tensor(torch.int32, 2 * CHUNK_DATA_WORDS + 1005, seed=4)
    base = digest(data)
    c = CHUNK_DATA_WORDS
    for start in (c - 3, c - 1, c, 2 * c - 2):
        changed = data.clone()
        added(changed, [(start + at, delta) for at, delta in CRAFTED[name]])
        assert (digest(changed) == base).tolist() == [False, False], start


def test_pairs_at_distances_up_to_a_chunk_change_the_digest() -> None:
    data = random_tensor(torch.int32, CHUNK_DATA_WORDS + 2000, seed=6)
    base = digest(data)
    for distance in (1, 2, 3, 4, 5, 8, 15, 16, 17, 64, 255, 256, 4096, 65536, CHUNK_DATA_WORDS):
        for delta in (1, -1, 2, 1 << 16, -(1 << 31) + 1):
            changed = data.clone()
            added(changed, [(7, delta), (7 + distance, -delta)])
            assert (digest(changed) == base).tolist() == [False, False], (distance, delta)


def test_zeroed_runs_change_the_digest() -> None:
    plan, buf, pieces = _word_bucket(seed=1)
    for length in (2, 3, 4, 15, 16, 17, 100, 1000, 5000):
        changed = buf.clone()
        words = changed[: changed.numel() // 4 * 4].view(torch.int32)
        hit = []
        for j, (first, count) in enumerate(pieces):
            if count >= length:
                start = first + (j * 31) % (count - length + 1)
                assert words[start : start + length].ne(0).any()
                words[start : start + length] = 0
                hit.append(j)
        digests = BucketDigests.of_plan(plan)  # type: ignore[arg-type]
        base, got = digests.of(0, buf), digests.of(0, changed)
        for j in hit:
            assert (got[j] == base[j]).tolist() == [False, False], (length, j)


def test_a_word_moved_to_another_position_changes_the_digest() -> None:
    data = random_tensor(torch.int32, 20_000, seed=8)
    base = digest(data)
    for i, j in [(0, 1), (0, 2), (5, 21), (100, 1100), (3, 19_999), (19_998, 4)]:
        copied = data.clone()
        copied[j] = data[i]  # a stale or misdirected word
        moved = data.clone()  # word i taken out and put back at j, the words between shifted
        lo, hi = min(i, j), max(i, j)
        moved[lo : hi + 1] = data[lo : hi + 1].roll(1 if j < i else -1)
        for changed in (copied, moved):
            assert not torch.equal(changed, data)
            assert (digest(changed) == base).tolist() == [False, False], (i, j)


def _thue_morse(n: int) -> list[int]:
    """+1/-1 by the parity of each index's bits: `prod(1 - x**(2**k) for k < log2(n))`."""
    return [1 - 2 * (bin(i).count("1") % 2) for i in range(n)]


def test_changes_that_lane_a_misses_are_caught_by_lane_b() -> None:
    """Two documented misses of the linear lane, on stage 2's words: +-1 on 2**10 words in
    Thue-Morse order, and the sign bits of two words flipped (changes of 2**63 each)."""
    g = torch.Generator().manual_seed(10)
    data = torch.randint(-(2**62), 2**62, (3 * 2**14 + 1,), dtype=torch.int64, generator=g)
    base = lanes(data)
    assert base.tolist() == reference_lanes(data.tolist())
    morse = data.clone()
    morse[100 : 100 + 2**10] += torch.tensor(_thue_morse(1 << 10))
    signs = data.clone()
    signs[[0, 2**14 + 3]] ^= -(2**63)
    for changed in (morse, signs):
        assert (lanes(changed) == base).tolist() == [True, False]


def test_thousands_of_random_small_weight_patterns_change_the_digest() -> None:
    """2 to 6 changed words within 8 or 64 words of each other or anywhere in a piece,
    each by +-1..+-2**k (k random, up to 31): 60 trials x 51 pieces, seeded."""
    plan, buf, pieces = _word_bucket(seed=2)
    rng = random.Random(1234)
    patterns = 0
    for _ in range(60):
        changes = {}
        for j, (first, count) in enumerate(pieces):
            size = min(count, rng.randint(2, 6))
            reach = min(count, rng.choice((8, 64, count)))  # near each other, or anywhere
            start = rng.randrange(count - reach + 1)
            at = rng.sample(range(reach), size)
            deltas = [rng.choice((-1, 1)) * rng.randint(1, 1 << rng.randint(0, 31)) for _ in at]
            changes[j] = [(first + start + a, d) for a, d in zip(at, deltas, strict=True)]
        _changed_pieces_detected(plan, buf, changes)
        patterns += len(changes)
    assert patterns == 60 * len(pieces) >= 3000


def test_views_and_byte_ranges_digest_their_own_bytes() -> None:
    matrix = random_tensor(torch.float32, 48 * 33, seed=5).view(48, 33)
    assert torch.equal(digest(matrix.t()), digest(matrix.t().contiguous()))
    assert torch.equal(digest(matrix[3:9, 2:7]), digest(matrix[3:9, 2:7].clone()))
    flat = as_bytes(matrix)
    for start, stop in [(0, 7), (1, 100), (3, 4000), (1001, 6003)]:  # unaligned starts too
        piece = flat[start:stop]
        assert digest(piece).tolist() == reference(piece.numpy().tobytes())


def _plan_and_bucket_bytes(
    metas: list[ParamMeta], buffer_bytes: int, seed: int = 0
) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
    """A plan, every parameter's bytes and each bucket as packed (padding left random)."""
    plan = plan_buckets(metas, buffer_bytes=buffer_bytes, min_bucket_bytes=0)
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (m.nbytes,), dtype=torch.uint8, generator=g) for m in metas]
    buckets = []
    for bucket in plan.buckets:
        buf = torch.randint(0, 256, (bucket.nbytes,), dtype=torch.uint8, generator=g)
        for p in bucket.pieces:
            buf[p.offset : p.offset + p.nbytes] = tensors[p.param][p.start : p.start + p.nbytes]
        buckets.append(buf)
    return plan, tensors, buckets


def _mixed_metas() -> list[ParamMeta]:
    """Small pieces of odd sizes (several windows of them), an empty one, a large one."""
    metas = [
        ParamMeta(f"layers.{i // 8}.p{i}", torch.float16 if i % 3 else torch.int8, (1 + 97 * i,))
        for i in range(400)
    ]
    metas.insert(5, ParamMeta("layers.0.empty", torch.float32, (0,)))
    metas.append(ParamMeta("head.weight", torch.float32, (CHUNK_DATA_WORDS + 3,)))  # chunked
    return metas


@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20, 16 << 20])
def test_bucket_digests_are_the_digests_of_each_piece(buffer_bytes: int) -> None:
    metas = _mixed_metas()
    if buffer_bytes == 16 << 20:  # one bucket spanning more than one window of small pieces
        metas = [*metas, *(ParamMeta(f"more.{i}", torch.float32, (5000,)) for i in range(300))]
        assert sum(m.nbytes for m in metas) > CHUNK_BYTES
    plan, tensors, buckets = _plan_and_bucket_bytes(metas, buffer_bytes)
    digests = BucketDigests.of_plan(plan)
    assert BucketDigests.of_plan(plan) is digests  # built once per plan
    for k, bucket in enumerate(plan.buckets):
        got = digests.of(k, buckets[k])
        want = [
            digest(tensors[p.param][p.start : p.start + p.nbytes]).tolist() for p in bucket.pieces
        ]
        assert got.tolist() == want, k


def test_the_digests_do_not_depend_on_the_window_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an accelerator's larger windows change is the batching, not the values."""
    metas = [*_mixed_metas(), *(ParamMeta(f"more.{i}", torch.float32, (777,)) for i in range(40))]
    plan, _, buckets = _plan_and_bucket_bytes(metas, 1 << 20)
    big = random_tensor(torch.int32, 3 * CHUNK_DATA_WORDS + 5, seed=11)
    want = [BucketDigests(plan).of(k, b).tolist() for k, b in enumerate(buckets)]
    want_big = digest(big).tolist()
    monkeypatch.setattr(digest_module, "WINDOW_WORDS", 1 << 10)  # more chunks and windows
    assert [BucketDigests(plan).of(k, b).tolist() for k, b in enumerate(buckets)] == want
    monkeypatch.setattr(digest_module, "KEPT_SUM_BLOCKS", 4)  # every bucket's sums its own
    assert [BucketDigests(plan).of(k, b).tolist() for k, b in enumerate(buckets)] == want
    assert digest(big).tolist() == want_big


def test_the_check_names_the_first_parameter_that_differs_and_ignores_padding() -> None:
    metas = [ParamMeta(f"layers.0.p{i}", torch.bfloat16, (7 + i,)) for i in range(6)]
    plan, _, buckets = _plan_and_bucket_bytes(metas, 1 << 16)
    assert len(plan.buckets) == 1
    digests = BucketDigests(plan)
    expected = digests.of(0, buckets[0])
    pieces = plan.buckets[0].pieces
    padding = pieces[1].offset + pieces[1].nbytes  # before piece 2's aligned offset
    assert padding < pieces[2].offset
    buckets[0][padding] ^= 0xFF
    digests.check(0, buckets[0], expected)  # padding is not sent as a parameter's bytes
    buckets[0][pieces[3].offset + pieces[3].nbytes - 1] ^= 0x01  # its last (tail) byte
    buckets[0][pieces[4].offset] ^= 0x01
    with pytest.raises(DigestMismatch, match=r"bucket 0 of 1: parameter 'layers.0.p3'") as err:
        digests.check(0, buckets[0], expected)
    assert (err.value.bucket, err.value.param) == (0, "layers.0.p3")


def test_a_split_tensor_is_named_with_its_byte_range() -> None:
    metas = [ParamMeta("w", torch.float32, (3000,))]  # 12000 bytes over 4096-byte buckets
    plan, _, buckets = _plan_and_bucket_bytes(metas, 4096)
    digests = BucketDigests(plan)
    expected = digests.of(1, buckets[1])
    buckets[1][10] ^= 0x40
    with pytest.raises(DigestMismatch, match=r"bucket 1 of 3: parameter 'w' \(bytes 4096..8192"):
        digests.check(1, buckets[1], expected)


def test_the_check_refuses_digests_of_the_wrong_shape() -> None:
    plan, _, buckets = _plan_and_bucket_bytes([ParamMeta("w", torch.float32, (4,))], 1024)
    with pytest.raises(ValueError, match="digests of bucket 0"):
        BucketDigests(plan).check(0, buckets[0], torch.zeros(2, 2, dtype=torch.int64))


def test_the_digest_room_sits_after_the_bucket_bytes() -> None:
    room = DigestRoom.of(1 << 20)
    assert (room.max_pieces, room.offset) == (1024, (1 << 20) - 16 * 1024)
    assert DigestRoom.of(256 << 20).max_pieces == 1 << 16  # at most 1 MiB of room
    small = DigestRoom.of(2048)
    assert (small.max_pieces, small.offset) == (2, 2048 - 64)
    slot = torch.zeros(2048, dtype=torch.uint8)
    small.view(slot, 2).copy_(torch.tensor([[1, 2], [3, 4]]))
    assert slot[: small.offset].eq(0).all() and slot[small.offset :].ne(0).any()
    with pytest.raises(ValueError, match="packed_buffer_size_bytes"):
        DigestRoom.of(100)
    with pytest.raises(ValueError, match="holds 2 pieces"):
        small.view(slot, 3)


def test_plan_buckets_with_max_pieces_closes_buckets_at_that_many_pieces() -> None:
    metas = [ParamMeta(f"layers.{i // 4}.p{i}", torch.float32, (1 + i,)) for i in range(40)]
    metas.append(ParamMeta("layers.9.big", torch.float32, (5000,)))  # split across buckets
    plan = plan_buckets(metas, buffer_bytes=4096, min_bucket_bytes=1 << 20, max_pieces=3)
    assert max(len(b.pieces) for b in plan.buckets) == 3
    unlimited = plan_buckets(metas, buffer_bytes=4096, min_bucket_bytes=1 << 20)
    assert max(len(b.pieces) for b in unlimited.buckets) > 3
    sent = {}
    for bucket in plan.buckets:
        for p in bucket.pieces:
            sent.setdefault(p.param, 0)
            sent[p.param] += p.nbytes
    assert sent == {i: m.nbytes for i, m in enumerate(metas)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_digests_on_cuda_equal_those_on_cpu() -> None:
    plan, _, buckets = _plan_and_bucket_bytes(_mixed_metas(), 1 << 20)
    digests = BucketDigests(plan)
    for k in range(len(plan.buckets)):
        on_device = digests.of(k, buckets[k].cuda())
        assert on_device.device.type == "cuda"
        assert on_device.cpu().tolist() == digests.of(k, buckets[k]).tolist()


# ------------------------------------------------- the pipeline's check before a load


@pytest.mark.parametrize("corruption", ["flipped byte", "+1-2+1 on three words"])
def test_the_pipeline_checks_each_bucket_before_its_load_and_loads_nothing_after(
    corruption: str,
) -> None:
    metas = [ParamMeta(f"layers.{i}.w", torch.float32, (300,)) for i in range(6)]
    plan, _, buckets = _plan_and_bucket_bytes(metas, 1500)
    digests = BucketDigests(plan)
    expected = [digests.of(k, b) for k, b in enumerate(buckets)]
    loaded: list[str] = []
    seen: list[int] = []

    def corrupt(k: int, buf: torch.Tensor) -> None:
        seen.append(k)
        if k == 2 and corruption == "flipped byte":
            buf[5] ^= 0x10
        elif k == 2:  # words 40..42 of layers.2.w: a change both old sums missed
            added(buf[:1200].view(torch.int32), [(40 + at, d) for at, d in CRAFTED["+1-2+1"]])

    pipeline = LoadPipeline(lambda tensors: loaded.extend(n for n, _ in tensors), 2, 5.0, name="t")
    unpacker = Unpacker(plan, "cpu")
    try:
        with on_bucket_landed(corrupt):
            for k, buf in enumerate(buckets):
                pipeline.before_receive(k)
                pipeline.received(k, buf, unpacker, expected[k])
            with pytest.raises(LoadFailed, match=r"bucket 2 of 6: parameter 'layers.2.w'"):
                pipeline.finish()
    finally:
        pipeline.close()
    assert seen == list(range(6))  # the hook saw every bucket, draining or not
    assert loaded == ["layers.0.w", "layers.1.w"]  # nothing from the corrupt bucket on


def test_without_digests_the_pipeline_loads_as_before() -> None:
    metas = [ParamMeta(f"layers.{i}.w", torch.int8, (33,)) for i in range(4)]
    plan, tensors, buckets = _plan_and_bucket_bytes(metas, 128)
    loaded: dict[str, torch.Tensor] = {}
    pipeline = LoadPipeline(lambda ts: loaded.update((n, t.clone()) for n, t in ts), 2, 5.0,
                            name="t")  # fmt: skip
    unpacker = Unpacker(plan, "cpu")
    try:
        for k, buf in enumerate(buckets):
            pipeline.before_receive(k)
            pipeline.received(k, buf, unpacker)
        pipeline.finish()
    finally:
        pipeline.close()
    assert {n: as_bytes(t).tolist() for n, t in loaded.items()} == {
        m.name: t.tolist() for m, t in zip(metas, tensors, strict=True)
    }
