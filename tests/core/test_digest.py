"""Verified bytes on their own: the digest, per-bucket digests, the digest room, and the
pipeline's check before a load (`weight_transfer.transport.digest`, `LoadPipeline.received`)."""

from __future__ import annotations

import struct

import pytest
import torch

from weight_transfer.backend import (
    LoadFailed,
    LoadPipeline,
    ParamMeta,
    Unpacker,
    as_bytes,
    plan_buckets,
)
from weight_transfer.transport.digest import (
    LARGE_BYTES,
    RECEIVE_HOOKS,
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


def reference(data: bytes) -> list[int]:
    """The documented definition, in Python integers: S1, S2 of the little-endian words
    (a zero-padded tail word last), modulo 2**64 as signed int64."""
    m = len(data) // 4
    words = [struct.unpack_from("<i", data, 4 * i)[0] for i in range(m)]
    if len(data) % 4:
        words.append(int.from_bytes(data[4 * m :], "little"))
    s1 = sum(words)
    s2 = sum((i + 1) * w for i, w in enumerate(words))
    return [(s + 2**63) % 2**64 - 2**63 for s in (s1, s2)]


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


@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 4, 5, 63, 64, 1001, 300_001])
def test_the_digest_is_the_documented_sums(nbytes: int) -> None:
    data = random_tensor(torch.uint8, nbytes, seed=nbytes)
    assert digest(data).tolist() == reference(data.numpy().tobytes())


def test_the_sums_wrap_modulo_two_to_the_64_as_documented() -> None:
    data = torch.full((3 << 20,), 0x7F, dtype=torch.uint8)  # S2 near 2**71: it wraps
    assert digest(data).tolist() == reference(data.numpy().tobytes())


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
    metas.append(ParamMeta("head.weight", torch.float32, (LARGE_BYTES // 4 + 3,)))
    return metas


@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20, 16 << 20])
def test_bucket_digests_are_the_digests_of_each_piece(buffer_bytes: int) -> None:
    metas = _mixed_metas()
    if buffer_bytes == 16 << 20:  # one bucket spanning more than one window of small pieces
        metas = [*metas, *(ParamMeta(f"more.{i}", torch.float32, (5000,)) for i in range(300))]
        assert sum(m.nbytes for m in metas) > 4 * WINDOW_WORDS
    plan, tensors, buckets = _plan_and_bucket_bytes(metas, buffer_bytes)
    digests = BucketDigests.of_plan(plan)
    assert BucketDigests.of_plan(plan) is digests  # built once per plan
    for k, bucket in enumerate(plan.buckets):
        got = digests.of(k, buckets[k])
        want = [
            digest(tensors[p.param][p.start : p.start + p.nbytes]).tolist() for p in bucket.pieces
        ]
        assert got.tolist() == want, k


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


def test_the_pipeline_checks_each_bucket_before_its_load_and_loads_nothing_after() -> None:
    metas = [ParamMeta(f"layers.{i}.w", torch.float32, (300,)) for i in range(6)]
    plan, _, buckets = _plan_and_bucket_bytes(metas, 1500)
    digests = BucketDigests(plan)
    expected = [digests.of(k, b) for k, b in enumerate(buckets)]
    loaded: list[str] = []
    seen: list[int] = []

    def corrupt(k: int, buf: torch.Tensor) -> None:
        seen.append(k)
        if k == 2:
            buf[5] ^= 0x10

    pipeline = LoadPipeline(lambda tensors: loaded.extend(n for n, _ in tensors), 2, 5.0, name="t")
    unpacker = Unpacker(plan, "cpu")
    RECEIVE_HOOKS.append(corrupt)
    try:
        for k, buf in enumerate(buckets):
            pipeline.before_receive(k)
            pipeline.received(k, buf, unpacker, expected[k])
        with pytest.raises(LoadFailed, match=r"bucket 2 of 6: parameter 'layers.2.w'"):
            pipeline.finish()
    finally:
        RECEIVE_HOOKS.remove(corrupt)
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
