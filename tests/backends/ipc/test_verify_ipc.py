"""wt-ipc with verified bytes (`verify=True`): the trainer leaves every bucket's digests in
its staging buffer's digest room; each worker checks the bucket before loading it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.backends.ipc.models import BIG
from tests.harness import WorkerPool, assert_received, digest
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from wt_ipc import IPCTrainerInitInfo

MODEL = "tests.backends.ipc.models:mixed_model"

WIRE_MODES = {
    "packed": {"packed": True, "packed_buffer_size_bytes": 1 << 20},
    "packed-small-buffers": {  # two pieces per bucket at most (the digest room)
        "packed": True,
        "packed_buffer_size_bytes": 2048,
        "packed_min_bucket_bytes": 0,
    },
    "packed-one-buffer": {
        "packed": True,
        "packed_buffer_size_bytes": 4096,
        "packed_num_buffers": 1,
    },
    "unpacked-small-buffers": {"packed": False, "packed_buffer_size_bytes": 2048},
}


def connect(pool: WorkerPool, source: Any, **wire: Any) -> Any:
    wire.setdefault("timeout_s", 30.0)
    info = IPCTrainerInitInfo(rank=0, num_workers=len(pool.processes), verify=True, **wire)
    return WeightTransferTrainerFactory.trainer_init(info, client=pool.client(), source=source)


def weights(pool: WorkerPool) -> list[dict[str, str]]:
    return [{n: digest(t) for n, t in sd.items()} for sd in pool.each("state_dict")]


@pytest.mark.parametrize("mode", list(WIRE_MODES))
def test_verified_rounds_are_bit_exact(mode: str) -> None:
    tensors = mixed_tensors(0, big_numel=3000)  # 12 KB: split over the small buffers
    with WorkerPool("ipc", 2) as pool:
        pool.each("set_names", list(tensors))
        engine = connect(pool, DictSource(tensors), **WIRE_MODES[mode])
        plan = engine.plan_for(engine.source.metadata())
        room = WIRE_MODES[mode]["packed_buffer_size_bytes"] // 1024
        assert max(len(b.pieces) for b in plan.buckets) <= max(1, room)
        for round_ in range(3):
            fresh = mixed_tensors(round_ + 1, big_numel=3000)
            for name, t in tensors.items():
                t.copy_(fresh[name])
            engine.send_weights()
            assert_received(pool, tensors)
        engine.shutdown()


def test_buffers_too_small_for_a_digest_room_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"packed_buffer_size_bytes.*verify=True"):
        IPCTrainerInitInfo(rank=0, verify=True, packed_buffer_size_bytes=100)


def test_a_byte_flipped_in_the_staging_refuses_the_round_and_keeps_the_previous_weights() -> None:
    """One worker: the staging is shared memory, so a byte flipped there is seen by every
    worker that reads it afterwards."""
    first = mixed_tensors(1, big_numel=BIG)
    with WorkerPool("ipc", 1, model_factory=MODEL) as pool:
        engine = connect(pool, DictSource(first), packed_buffer_size_bytes=4096,
                         packed_min_bucket_bytes=0)  # fmt: skip
        engine.send_weights()
        before = {n: digest(t) for n, t in first.items()}
        assert weights(pool) == [before]

        engine.source = DictSource(mixed_tensors(2, big_numel=BIG))
        plan = engine.plan_for(engine.source.metadata())
        k = len(plan.buckets) // 2
        piece = plan.buckets[k].pieces[-1]
        name = plan.params[piece.param].name
        pool.on(0, "corrupt", k, piece.offset + piece.nbytes - 1)
        try:
            t0 = time.monotonic()
            with pytest.raises(WeightSyncRPCError) as err:
                engine.send_weights()
            assert time.monotonic() - t0 < 10
        finally:
            pool.on(0, "corrupt", None)
        assert f"bucket {k} of {len(plan.buckets)}: parameter {name!r}" in str(err.value)
        assert weights(pool) == [before]

        third = mixed_tensors(3, big_numel=BIG)
        engine.source = DictSource(third)
        engine.send_weights()  # the link carries the next round
        assert weights(pool) == [{n: digest(t) for n, t in third.items()}]
        engine.shutdown()
