"""wt-ipc with verified bytes (`verify=True`): the trainer leaves every bucket's digests in
its staging buffer's digest room; each worker checks the bucket before loading it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.backends.ipc.models import BIG, module_of
from tests.harness import WorkerPool, digest, ipc_trainer, weights
from tests.sources import DictSource, mixed_tensors
from weight_transfer import (
    WeightSyncRPCError,
    WeightTransferConfig,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
    WorkerPosition,
    WorkerSession,
)
from weight_transfer.testing.seams import on_bucket_landed
from wt_ipc import IPCTrainerInitInfo
from wt_kits.stream import LoadFailed

MODEL = "tests.backends.ipc.models:mixed_model"


def connect(pool: WorkerPool, source: Any, **wire: Any) -> Any:
    return ipc_trainer(pool, source, verify=True, **wire)


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


def test_three_words_changed_by_plus_one_minus_two_plus_one_refuse_the_round() -> None:
    """Trainer and worker in this process (the worker driven through core's
    `WorkerSession`), so the test-only receive hook here changes the bucket as the worker
    receives it: three consecutive words of `mlp.big.weight` by +1, -2, +1, a change
    both sums of a plain weighted sum (sum(w), sum(i * w)) miss."""
    first = mixed_tensors(1, big_numel=BIG)
    model = module_of(mixed_tensors(0, big_numel=BIG))
    worker = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig("ipc"), WorkerPosition(), "cpu", model
    )
    info = IPCTrainerInitInfo(rank=0, verify=True, packed_buffer_size_bytes=4096, timeout_s=30.0)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=WorkerSession(worker), source=DictSource(first)
    )
    engine.send_weights()
    before = {n: digest(p) for n, p in model.named_parameters()}
    assert before == {n: digest(t) for n, t in first.items()}
    name = "model.layers.1.mlp.big.weight"
    engine.source = DictSource(mixed_tensors(2, big_numel=BIG))
    plan = engine.plan_for(engine.source.metadata())
    k, piece = next(
        (k, p)
        for k, b in enumerate(plan.buckets)
        for p in b.pieces
        if plan.params[p.param].name == name and p.start > 0  # a middle part of it
    )

    def plus_one_minus_two_plus_one(bucket: int, buf: torch.Tensor) -> None:
        if bucket == k:
            words = buf[piece.offset : piece.offset + 64].view(torch.int32)
            words[5:8] += torch.tensor([1, -2, 1], dtype=torch.int32)

    where = rf"bucket {k} of {len(plan.buckets)}: parameter {name!r} \(bytes {piece.start}\.\."
    with (
        on_bucket_landed(plus_one_minus_two_plus_one),
        pytest.raises(LoadFailed, match=where) as err,  # in-process: core's own error
    ):
        engine.send_weights()
    assert "arrived different" in str(err.value)
    assert {n: digest(p) for n, p in model.named_parameters()} == before  # rolled back

    third = mixed_tensors(3, big_numel=BIG)
    engine.source = DictSource(third)
    engine.send_weights()  # the next round is carried
    assert {n: digest(p) for n, p in model.named_parameters()} == {
        n: digest(t) for n, t in third.items()
    }
    engine.shutdown()
    worker.shutdown()
