"""The packed layout (`plan_buckets`) and the `Unpacker`, with real bytes."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from tests.harness import digest
from weight_transfer import ParamMeta, layerwise_groups
from wt_kits.stream.packing import (
    ALIGNMENT,
    BucketPlan,
    RotatingBuffers,
    Unpacker,
    as_bytes,
    plan_buckets,
)

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.bool,
    torch.int64,
    torch.uint8,
    torch.float64,
]


def random_metas(seed: int, layers: int = 6) -> list[ParamMeta]:
    """Mixed dtypes, odd element counts, zero-element tensors, un-indexed runs at both ends."""
    rng = random.Random(seed)
    metas = [ParamMeta("model.embed.weight", torch.bfloat16, (rng.randint(1, 40), 3))]
    for layer in range(layers):
        for j in range(rng.randint(1, 4)):
            dtype = rng.choice(DTYPES)
            shape: tuple[int, ...] = rng.choice(
                [(rng.randint(1, 9),), (rng.randint(0, 5), rng.randint(1, 7)), (0,), ()]
            )
            metas.append(ParamMeta(f"model.layers.{layer}.p{j}", dtype, shape))
    metas.append(ParamMeta("model.norm.weight", torch.int8, (13,)))
    metas.append(ParamMeta("lm_head.weight", torch.float32, (rng.randint(1, 90), 5)))
    return metas


def make_tensor(meta: ParamMeta, gen: torch.Generator) -> torch.Tensor:
    if meta.dtype == torch.bool:
        return torch.rand(meta.shape, generator=gen) > 0.5
    raw = torch.randint(0, 256, (meta.nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(meta.dtype).reshape(meta.shape)


def pack(plan: BucketPlan, k: int, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
    """What a sender does: copy each piece's byte range to its offset in the bucket."""
    for piece in plan.buckets[k].pieces:
        src = as_bytes(tensors[piece.param])[piece.start : piece.start + piece.nbytes]
        buf[piece.offset : piece.offset + piece.nbytes].copy_(src)


def check_layout(plan: BucketPlan, buffer_bytes: int, min_bucket_bytes: int) -> None:
    metas = plan.params
    groups = layerwise_groups(m.name for m in metas)
    group_of = {name: gi for gi, g in enumerate(groups) for name in g}
    group_bytes = [0] * len(groups)
    for m in metas:
        group_bytes[group_of[m.name]] += -(-m.nbytes // ALIGNMENT) * ALIGNMENT
    covered = [0] * len(metas)
    buckets_of_group: dict[int, set[int]] = {}
    for k, bucket in enumerate(plan.buckets):
        assert 0 <= bucket.nbytes <= buffer_bytes
        end = 0
        for piece in bucket.pieces:
            assert piece.offset % ALIGNMENT == 0, piece
            assert piece.offset + piece.nbytes <= bucket.nbytes
            if piece.nbytes:
                assert piece.offset >= end, "pieces overlap"
                end = piece.offset + piece.nbytes
            assert piece.start == covered[piece.param], "byte ranges out of order"
            covered[piece.param] += piece.nbytes
            buckets_of_group.setdefault(group_of[metas[piece.param].name], set()).add(k)
        assert end == bucket.nbytes
    assert covered == [m.nbytes for m in metas]
    for gi, ks in buckets_of_group.items():
        assert ks == set(range(min(ks), max(ks) + 1)), "a group's buckets are consecutive"
        if group_bytes[gi] <= buffer_bytes:
            assert len(ks) == 1, f"group {groups[gi]} fits one buffer but was split"
        for i, m in enumerate(metas):
            if group_of[m.name] == gi:
                assert plan.group_end[i] == max(ks)
    # a bucket ends inside a group only when the group is larger than a buffer
    for k in range(len(plan.buckets) - 1):
        last = group_of[metas[plan.buckets[k].pieces[-1].param].name]
        first = group_of[metas[plan.buckets[k + 1].pieces[0].param].name]
        if last == first:
            assert group_bytes[last] > buffer_bytes
        elif min_bucket_bytes:
            # closed early only when full enough, or when the next group would not fit
            n = plan.buckets[k].nbytes
            aligned = -(-n // ALIGNMENT) * ALIGNMENT
            assert n >= min_bucket_bytes or aligned + group_bytes[first] > buffer_bytes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("buffer_bytes", "min_bucket_bytes"), [(64, 0), (256, 0), (512, 200), (4096, 10**9)]
)
def test_layout_properties_and_bit_exact_round_trip(
    seed: int, buffer_bytes: int, min_bucket_bytes: int
) -> None:
    metas = random_metas(seed)
    names = [m.name for m in metas]
    plan = plan_buckets(metas, buffer_bytes=buffer_bytes, min_bucket_bytes=min_bucket_bytes)
    again = plan_buckets(list(metas), buffer_bytes=buffer_bytes, min_bucket_bytes=min_bucket_bytes)
    assert plan == again
    assert plan.total_bytes == sum(m.nbytes for m in metas)
    assert plan.max_bucket_bytes <= buffer_bytes
    check_layout(plan, buffer_bytes, min_bucket_bytes)

    gen = torch.Generator().manual_seed(seed)
    tensors = [make_tensor(m, gen) for m in metas]
    buffers = RotatingBuffers(2, "cpu")
    recv = RotatingBuffers(1, "cpu")
    unpacker = Unpacker(plan, "cpu")
    out: list[tuple[str, str]] = []
    held: list[
        tuple[str, torch.Tensor]
    ] = []  # what a layerwise consumer keeps until its group ends
    for k, bucket in enumerate(plan.buckets):
        send = buffers.get(k, bucket.nbytes)
        send.fill_(0xAB)  # padding content must not matter
        pack(plan, k, tensors, send)
        wire = recv.get(0, bucket.nbytes)  # one receive buffer, reused for every bucket
        wire.copy_(send)
        held.extend(unpacker.unpack(k, wire))
        # the group of everything held completes no later than this bucket: consume now
        done = [i for i, (n, _) in enumerate(held) if plan.group_end[names.index(n)] == k]
        out.extend((held[i][0], digest(held[i][1])) for i in done)
        held = [h for i, h in enumerate(held) if i not in done]
    assert held == []
    assert out == [(m.name, digest(t)) for m, t in zip(metas, tensors, strict=True)]


def test_a_tensor_larger_than_the_buffer_is_split_and_reassembled() -> None:
    gen = torch.Generator().manual_seed(0)
    metas = [
        ParamMeta("a.0.small", torch.int8, (3,)),
        ParamMeta("a.0.big", torch.bfloat16, (1001,)),  # 2002 bytes, odd element count
        ParamMeta("a.1.bool", torch.bool, (7,)),
    ]
    plan = plan_buckets(metas, buffer_bytes=256)
    big_pieces = [(k, p) for k, b in enumerate(plan.buckets) for p in b.pieces if p.param == 1]
    # it fills what the small tensor left of bucket 0, then whole buffers, then a tail
    assert [(k, p.start, p.nbytes, p.offset) for k, p in big_pieces] == [
        (0, 0, 192, 64),
        *[(k, 192 + 256 * (k - 1), 256, 0) for k in range(1, 8)],
        (8, 1984, 18, 0),
    ]
    tensors = [make_tensor(m, gen) for m in metas]
    unpacker = Unpacker(plan, "cpu")
    got: dict[str, torch.Tensor] = {}
    for k, bucket in enumerate(plan.buckets):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack(plan, k, tensors, buf)
        for name, t in unpacker.unpack(k, buf):
            assert name not in got
            got[name] = t
            if name == "a.0.big":
                assert k == big_pieces[-1][0], "a split tensor is returned when it completes"
    assert {n: digest(t) for n, t in got.items()} == {
        m.name: digest(t) for m, t in zip(metas, tensors, strict=True)
    }


def test_zero_element_tensors() -> None:
    metas = [
        ParamMeta("l.0.empty", torch.float32, (0, 4)),
        ParamMeta("l.0.w", torch.float32, (2,)),
        ParamMeta("l.1.empty", torch.bfloat16, (0,)),
    ]
    plan = plan_buckets(metas, buffer_bytes=64)
    unpacker = Unpacker(plan, "cpu")
    tensors = [torch.empty(0, 4), torch.tensor([1.5, -2.0]), torch.empty(0, dtype=torch.bfloat16)]
    out = []
    for k, bucket in enumerate(plan.buckets):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack(plan, k, tensors, buf)
        out += unpacker.unpack(k, buf)
    assert [(n, t.dtype, tuple(t.shape)) for n, t in out] == [
        ("l.0.empty", torch.float32, (0, 4)),
        ("l.0.w", torch.float32, (2,)),
        ("l.1.empty", torch.bfloat16, (0,)),
    ]
    assert torch.equal(out[1][1], tensors[1])


def test_view_horizon_decides_between_views_and_copies() -> None:
    # one layer of three 128-byte tensors in 256-byte buffers: buckets [t0, t1], [t2]
    metas = [ParamMeta(f"layers.0.t{i}", torch.float32, (32,)) for i in range(3)]
    plan = plan_buckets(metas, buffer_bytes=256)
    assert [[p.param for p in b.pieces] for b in plan.buckets] == [[0, 1], [2]]
    assert plan.group_end == (1, 1, 1)
    tensors = [torch.full((32,), float(i + 1)) for i in range(3)]

    def received(k: int, horizon: int) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
        buf = torch.empty(plan.buckets[k].nbytes, dtype=torch.uint8)
        pack(plan, k, tensors, buf)
        return buf, Unpacker(plan, "cpu").unpack(k, buf, view_horizon=horizon)

    buf, out = received(0, horizon=0)  # the group ends a bucket later: copies
    buf.fill_(0)
    assert [torch.equal(t, tensors[i]) for i, (_, t) in enumerate(out)] == [True, True]

    buf, out = received(0, horizon=1)  # the caller keeps the buffer that long: views
    assert all(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for _, t in out)
    buf.fill_(0)
    assert [bool((t == 0).all()) for _, t in out] == [True, True]

    buf, out = received(1, horizon=0)  # the group's last bucket: a view is safe
    assert out[0][1].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(out[0][1], tensors[2])


def test_group_boundaries_and_min_bucket_bytes() -> None:
    metas = [ParamMeta(f"layers.{i}.w", torch.float32, (16,)) for i in range(4)]  # 64 B each
    assert [len(b.pieces) for b in plan_buckets(metas, buffer_bytes=1024).buckets] == [1, 1, 1, 1]
    assert [
        len(b.pieces) for b in plan_buckets(metas, buffer_bytes=1024, min_bucket_bytes=128).buckets
    ] == [2, 2]
    assert [
        len(b.pieces) for b in plan_buckets(metas, buffer_bytes=192, min_bucket_bytes=10**6).buckets
    ] == [3, 1]
    explicit = plan_buckets(
        metas, buffer_bytes=1024, min_bucket_bytes=10**6, groups=[[m.name for m in metas]]
    )
    assert [len(b.pieces) for b in explicit.buckets] == [4]
    assert explicit.group_end == (0, 0, 0, 0)


def test_bad_arguments() -> None:
    metas = [ParamMeta("a", torch.float32, (1,)), ParamMeta("b", torch.float32, (1,))]
    with pytest.raises(ValueError, match=f"buffer_bytes must be at least {ALIGNMENT}"):
        plan_buckets(metas, buffer_bytes=32)
    with pytest.raises(
        ValueError, match="groups must partition the parameter names in metadata order"
    ):
        plan_buckets(metas, buffer_bytes=64, groups=[["b"], ["a"]])
    with pytest.raises(ValueError, match="packed_num_buffers must be at least 1"):
        RotatingBuffers(0, "cpu")


def test_rotating_buffers_reuse_and_grow() -> None:
    bufs = RotatingBuffers(2, "cpu")
    a = bufs.get(0, 100)
    b = bufs.get(1, 50)
    assert a.numel() == 100 and b.numel() == 50
    assert bufs.get(2, 80).data_ptr() == a.data_ptr()  # slot 0 again, big enough
    grown = bufs.get(3, 200)
    assert grown.numel() == 200 and grown.data_ptr() != b.data_ptr()
    assert len(bufs) == 2
    bufs.release()
    assert bufs.get(0, 1).numel() == 1


def test_an_unchanged_layout_gets_the_same_plan_and_a_changed_one_a_new_plan() -> None:
    metas = random_metas(seed=11)
    plan = plan_buckets(metas, buffer_bytes=256)
    again = [ParamMeta(m.name, m.dtype, m.shape) for m in metas]  # equal, not the same objects
    assert plan_buckets(again, buffer_bytes=256) is plan
    assert plan_buckets(metas, buffer_bytes=512) is not plan
    grown = [*metas[:-1], ParamMeta(metas[-1].name, metas[-1].dtype, (1000, 5))]
    other = plan_buckets(grown, buffer_bytes=256)
    assert other is not plan and other.params[-1].shape == (1000, 5)
    check_layout(other, 256, 0)


def test_unpacking_through_the_buffers_reuses_their_views_and_stays_exact() -> None:
    metas = random_metas(seed=5)
    plan = plan_buckets(metas, buffer_bytes=512)
    buffers = RotatingBuffers(2, "cpu")
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # a second round with new values reuses the first round's views
        tensors = [make_tensor(m, gen) for m in metas]
        unpacker = Unpacker(plan, "cpu", buffers)
        got: dict[str, torch.Tensor] = {}
        for k, bucket in enumerate(plan.buckets):
            buf = buffers.get(k, bucket.nbytes)
            pack(plan, k, tensors, buf)
            views = {v.data_ptr(): v for v in buffers.views(plan, k)}
            for name, t in unpacker.unpack(k, buf, view_horizon=len(plan.buckets)):
                got[name] = t.clone()
                whole = [p for p in bucket.pieces if plan.params[p.param].name == name]
                if whole and whole[0].nbytes == plan.params[whole[0].param].nbytes and t.numel():
                    assert views.get(t.data_ptr()) is t, f"{name}: a new view per round"
        for meta, tensor in zip(metas, tensors, strict=True):
            assert digest(got[meta.name]) == digest(tensor), meta.name


def test_a_packed_finite_check_ignores_padding_and_names_the_bad_parameter() -> None:
    from wt_kits.stream.packing import Packer

    # odd sizes: alignment padding between the pieces; a buffer full of NaN bytes
    metas = [ParamMeta(f"layers.0.w{i}", torch.float32, (3 + i,)) for i in range(6)]
    plan = plan_buckets(metas, buffer_bytes=4096)
    assert len(plan.buckets) == 1
    buffers = RotatingBuffers(1, "cpu")
    buffers.get(0, plan.buckets[0].nbytes).view(torch.float32)[:] = float("nan")
    tensors = [torch.arange(m.numel, dtype=torch.float32) for m in metas]
    Packer(plan, iter(zip(metas, tensors, strict=True)), finite=True).pack(0, buffers)
    tensors[4] = tensors[4].clone()
    tensors[4][2] = float("inf")
    packer = Packer(plan, iter(zip(metas, tensors, strict=True)), finite=True)
    with pytest.raises(ValueError, match=r"'layers\.0\.w4' \(parameter #4\)"):
        packer.pack(0, buffers)


# -- the finite check of float8 ---------------------------------------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (dtype, byte): NaN (either sign) in both formats, and e5m2's two infinities
FLOAT8_NON_FINITE = [
    pytest.param(E5M2, 0x7E, id="e5m2-nan"),
    pytest.param(E5M2, 0xFD, id="e5m2-negative-nan"),
    pytest.param(E5M2, 0x7C, id="e5m2-inf"),
    pytest.param(E5M2, 0xFC, id="e5m2-negative-inf"),
    pytest.param(E4M3, 0x7F, id="e4m3fn-nan"),
    pytest.param(E4M3, 0xFF, id="e4m3fn-negative-nan"),
]


def float8_finite(dtype: torch.dtype, shape: tuple[int, ...], shift: int = 0) -> torch.Tensor:
    """Every finite value of `dtype` in turn, `shift` values on, as `shape`: its largest
    (448 or 57,344) of either sign, negative zero and the subnormals among them."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[codes.view(dtype).float().isfinite()]
    values = finite.view(dtype).float()
    top = torch.finfo(dtype).max
    assert top in (448.0, 57344.0) and {top, -top} <= set(values.tolist())
    assert (values == 0).logical_and(values.signbit()).any()  # negative zero
    picks = (torch.arange(math.prod(shape)) + shift) % len(finite)
    return finite[picks].view(dtype).reshape(shape)


def with_byte(tensor: torch.Tensor, index: int, byte: int) -> torch.Tensor:
    """A copy of `tensor` (of its strides) whose element `index`, in flat order, has the
    bits `byte`."""
    out = tensor.clone()
    out.view(torch.uint8)[torch.unravel_index(torch.tensor(index), out.shape)] = byte
    return out


FLOAT8_BUCKET = [  # one bucket: float8 runs of adjacent pieces, with padding between runs
    ParamMeta("layers.0.w0", torch.float32, (3,)),
    ParamMeta("layers.0.w1", E4M3, (64,)),
    ParamMeta("layers.0.w2", E4M3, (5,)),
    ParamMeta("layers.0.w3", E5M2, (64,)),
    ParamMeta("layers.0.w4", E5M2, (3, 7)),
    ParamMeta("layers.0.w5", torch.bfloat16, (2,)),
]


@pytest.mark.parametrize(("dtype", "byte"), FLOAT8_NON_FINITE)
@pytest.mark.parametrize("index", [0, -1])
def test_a_packed_finite_check_names_the_float8_parameter(
    dtype: torch.dtype, byte: int, index: int
) -> None:
    """Finite float8 (every finite value) packs bit-exact, the padding is not checked;
    a NaN or an infinity is refused naming its parameter, nothing of the bucket out."""
    from wt_kits.stream.packing import Packer, float_runs

    plan = plan_buckets(FLOAT8_BUCKET, buffer_bytes=4096)
    assert len(plan.buckets) == 1
    assert [run[0] for run in float_runs(plan, 0)] == [torch.float32, E4M3, E5M2, torch.bfloat16]
    buffers = RotatingBuffers(1, "cpu")
    buffers.get(0, plan.buckets[0].nbytes)[:] = 0xFF  # NaN in every float dtype here
    tensors = [
        float8_finite(m.dtype, m.shape, shift=37 * i)
        if m.dtype in (E4M3, E5M2)
        else torch.ones(m.shape, dtype=m.dtype)
        for i, m in enumerate(FLOAT8_BUCKET)
    ]
    tensors[4] = float8_finite(E5M2, (7, 3)).t()  # not contiguous
    out = Packer(plan, iter(zip(FLOAT8_BUCKET, tensors, strict=True)), finite=True).pack(0, buffers)
    for piece, tensor in zip(plan.buckets[0].pieces, tensors, strict=True):
        assert torch.equal(out[piece.offset : piece.offset + piece.nbytes], as_bytes(tensor))

    bad = 2 if dtype == E4M3 else 4  # the second piece of its dtype's run
    tensors[bad] = with_byte(tensors[bad], index % FLOAT8_BUCKET[bad].numel, byte)
    packer = Packer(plan, iter(zip(FLOAT8_BUCKET, tensors, strict=True)), finite=True)
    with pytest.raises(ValueError, match=rf"'layers\.0\.w{bad}' \(parameter #{bad}\)"):
        packer.pack(0, buffers)


# one-piece buckets: each parameter alone, the second larger than a bucket of `bytes_of`
FLOAT8_ALONE = [ParamMeta("layers.0.a", E5M2, (5, 8)), ParamMeta("layers.1.b", E4M3, (150,))]


def one_piece_buckets(path: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every bucket's bytes as `Packer.bytes_of` or `Packer.whole` hands them out."""
    from wt_kits.stream.packing import Packer, plan_per_tensor

    if path == "bytes_of":
        plan = plan_buckets(FLOAT8_ALONE, buffer_bytes=64)
        assert [len(b.pieces) for b in plan.buckets] == [1, 1, 1, 1]
    else:
        plan = plan_per_tensor(FLOAT8_ALONE, buffer_bytes=4096)
    packer = Packer(plan, iter(zip(FLOAT8_ALONE, tensors, strict=True)), finite=True)
    if path == "bytes_of":
        buffers = RotatingBuffers(1, "cpu")
        return [packer.bytes_of(k, buffers).clone() for k in range(len(plan.buckets))]
    return [as_bytes(packer.whole(k)) for k in range(len(plan.buckets))]


@pytest.mark.parametrize(("dtype", "byte"), FLOAT8_NON_FINITE)
@pytest.mark.parametrize("path", ["bytes_of", "whole"])
def test_a_one_piece_finite_check_names_the_float8_parameter(
    path: str, dtype: torch.dtype, byte: int
) -> None:
    """As the packed check, for a bucket of one piece (one tensor, or a piece of one
    split across buckets), sent from the source's memory or copied."""
    tensors = [float8_finite(E5M2, (8, 5)).t(), float8_finite(E4M3, (150,), shift=3)]
    got = torch.cat(one_piece_buckets(path, tensors))
    assert torch.equal(got, torch.cat([as_bytes(t) for t in tensors]))

    bad = 0 if dtype == E5M2 else 1
    tensors[bad] = with_byte(tensors[bad], tensors[bad].numel() - 1, byte)  # its last bucket
    name = FLOAT8_ALONE[bad].name.replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"'{name}' \(parameter #{bad}\)"):
        one_piece_buckets(path, tensors)
