"""wt-nccl with verified bytes (`verify=True`): digests after every bucket, checked by every
worker before the bucket is loaded; a byte flipped in transit refuses the round."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.backends.ipc.models import BIG
from tests.harness import WorkerPool, digest, nccl_trainer, weights
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightSyncRPCError

WORKERS = 2
MODEL = "tests.backends.ipc.models:mixed_model"


def connect(pool: WorkerPool, source: Any, **wire: Any) -> Any:
    return nccl_trainer(pool, source, verify=True, **wire)


@pytest.fixture(scope="module")
def model_pool() -> Any:
    with WorkerPool("nccl", WORKERS, model_factory=MODEL) as p:
        yield p


def target_byte(plan: Any, case: str) -> tuple[int, int, str]:
    """(bucket, byte offset in it, parameter) to flip: the first byte of the first bucket,
    or a tail byte (past the last whole 32-bit word) of a piece in a middle bucket."""
    if case == "first-byte":
        piece = plan.buckets[0].pieces[0]
        return 0, piece.offset, plan.params[piece.param].name
    for k in range(len(plan.buckets) // 2, len(plan.buckets)):
        for piece in plan.buckets[k].pieces:
            if piece.nbytes % 4:
                return k, piece.offset + piece.nbytes - 1, plan.params[piece.param].name
    raise AssertionError("no piece with tail bytes")


CORRUPTIONS = ["first-byte", "tail-byte"]


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_byte_flipped_in_transit_refuses_the_round_and_keeps_the_previous_weights(
    model_pool: WorkerPool, case: str
) -> None:
    pool = model_pool
    first = mixed_tensors(1, big_numel=BIG)
    engine = connect(pool, DictSource(first), packed_buffer_size_bytes=1024,
                     packed_min_bucket_bytes=0)  # fmt: skip
    engine.send_weights()
    before = {n: digest(t) for n, t in first.items()}
    assert weights(pool) == [before] * WORKERS

    second = mixed_tensors(2, big_numel=BIG)
    engine.source = DictSource(second)
    plan = engine.plan_for(engine.source.metadata())
    k, at, name = target_byte(plan, case)
    pool.on(1, "corrupt", k, at)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncRPCError) as err:
            engine.send_weights()
        assert time.monotonic() - t0 < 10
    finally:
        pool.on(1, "corrupt", None)
    message = str(err.value)
    assert "worker 1" in message and f"bucket {k} of {len(plan.buckets)}" in message
    assert f"parameter {name!r}" in message, message
    assert weights(pool)[1] == before  # rolled back
    # Worker 0 received every byte intact; the trainer's failed round aborts its round
    # in band (from a daemon thread), which rolls it back too.
    deadline = time.monotonic() + 10
    while weights(pool) != [before] * WORKERS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert weights(pool) == [before] * WORKERS

    third = mixed_tensors(3, big_numel=BIG)
    engine.source = DictSource(third)
    engine.send_weights()  # the group stayed in step: no new rendezvous
    assert weights(pool) == [{n: digest(t) for n, t in third.items()}] * WORKERS
    engine.shutdown()


def test_a_corrupt_round_left_open_elsewhere_is_rolled_back_by_the_next_start(
    model_pool: WorkerPool,
) -> None:
    """Without the explicit abort: the next round's start ends worker 0's open round."""
    pool = model_pool
    first = mixed_tensors(4, big_numel=BIG)
    engine = connect(pool, DictSource(first), packed_buffer_size_bytes=4096)
    engine.send_weights()
    engine.source = DictSource(mixed_tensors(5, big_numel=BIG))
    pool.on(1, "corrupt", 0, 3)
    try:
        with pytest.raises(WeightSyncRPCError, match="arrived different"):
            engine.send_weights()
    finally:
        pool.on(1, "corrupt", None)
    target = mixed_tensors(6, big_numel=BIG)
    engine.source = DictSource(target)
    engine.send_weights()
    assert weights(pool) == [{n: digest(t) for n, t in target.items()}] * WORKERS
    engine.shutdown()
