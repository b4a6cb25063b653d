"""wt-nccl over gloo: a trainer (this process or spawned ranks) and real worker processes."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from tests.harness import ForbiddenClient, WorkerPool, assert_received, digest, nccl_trainer
from tests.sources import (
    DictSource,
    DisagreeingSource,
    StallingSource,
    dtensor_model,
    mixed_tensors,
)
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from wt_kits.group.stateless import free_port
from wt_nccl import NCCLTrainerInitInfo

WORKERS = 2


@pytest.fixture(scope="module")
def pool() -> Any:
    with WorkerPool("nccl", WORKERS) as p:
        yield p


connect = nccl_trainer


@pytest.mark.parametrize("packed", [True, False])
def test_two_thousand_small_tensors(pool: WorkerPool, packed: bool) -> None:
    g = torch.Generator().manual_seed(7)
    tensors = {f"p.{i}.w": torch.randn(1 + i % 13, generator=g) for i in range(2000)}
    pool.each("set_names", list(tensors))
    engine = connect(pool, DictSource(tensors), packed=packed)
    engine.send_weights()
    assert_received(pool, tensors)
    engine.shutdown()


def test_tensor_larger_than_buffer_is_split_and_reassembled_without_a_pack_copy(
    pool: WorkerPool,
) -> None:
    from wt_tools.counting import AtenOps

    big = torch.randn(10_000, generator=torch.Generator().manual_seed(3))  # 40 KB
    tensors = {"a.weight": torch.arange(5, dtype=torch.int16), "b.weight": big}
    pool.each("set_names", list(tensors))
    engine = connect(pool, DictSource(tensors), packed_buffer_size_bytes=4096)
    buckets = engine.plan_for(DictSource(tensors).metadata()).buckets
    assert len(buckets) >= 10
    engine.send_weights()  # cold: the plan's round header, layout and statuses
    with AtenOps() as ops:
        engine.send_weights()
    assert_received(pool, tensors)
    # every bucket that is one piece of "b.weight" went out as the source's own bytes:
    # the trainer copied the packed bucket and its status tail, nothing else
    packed = [b for b in buckets if len(b.pieces) > 1]
    assert len(packed) == 1
    assert ops.copied_bytes == sum(sum(p.nbytes for p in b.pieces) + 16 for b in packed)
    # a non-contiguous source is copied once into contiguous bytes, and still exact
    tensors["b.weight"] = torch.randn(100, 100).t()
    engine.source = DictSource(tensors)
    engine.send_weights()
    assert_received(pool, tensors)
    engine.shutdown()


class _LateAnswers:
    """The pool's client, whose `update_weights` answers `delay_s` after the workers did."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        try:
            self.inner.update_weights(update_info)
        finally:
            time.sleep(self.delay_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


def test_a_source_error_surfaces_at_once_whatever_the_workers_answer(pool: WorkerPool) -> None:
    """The trainer never waits on the workers' update_weights on its error path."""
    tensors = mixed_tensors(12)
    pool.each("set_names", list(tensors))
    client = _LateAnswers(pool.client(), delay_s=8.0)
    info = NCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + WORKERS, rank=0, timeout_s=30.0,
        packed_buffer_size_bytes=1024, packed_min_bucket_bytes=0,
    )  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=DisagreeingSource(tensors, "redtype", 5)
    )
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="disagrees with metadata"):
        engine.send_weights()
    assert time.monotonic() - t0 < 4.0  # neither the late answer (8 s) nor the timeout (30 s)
    client.delay_s = 0.0
    engine.source = DictSource(tensors)
    engine.send_weights()  # waits for the last round's call to end, then runs
    assert_received(pool, tensors)
    engine.shutdown()


def test_worker_rejecting_update_info_fails_fast() -> None:
    """A worker that never enters the receive loop must not leave the trainer in a broadcast."""
    tensors = mixed_tensors(2)
    with WorkerPool("nccl", 1) as p:
        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, timeout_s=60)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=_Rewriting(p.client(), drop="shapes"), source=DictSource(tensors)
        )
        t0 = time.monotonic()
        with pytest.raises(WeightSyncRPCError, match="wt_auth"):  # altered: not the trainer's
            engine.send_weights()
        assert time.monotonic() - t0 < 10


def test_worker_init_error_surfaces_at_once() -> None:
    """A worker that rejects the handshake fails trainer_init without waiting for the store."""
    with WorkerPool("nccl", 1) as p:
        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 3, rank=0, timeout_s=120)
        t0 = time.monotonic()
        with pytest.raises(
            WeightSyncRPCError, match=r"field .rank_offset. must be in \[0, 2\], got 5"
        ):
            WeightTransferTrainerFactory.trainer_init(
                info,
                client=_Rewriting(p.client(), init_extra={"rank_offset": 5}),
                source=DictSource({}),
            )
        assert time.monotonic() - t0 < 10


class _Rewriting:
    """Forwards to `inner`, rewriting payloads: `init_extra` merged into the handshake,
    `drop` removed from update info."""

    def __init__(
        self, inner: Any, *, init_extra: dict[str, Any] | None = None, drop: str | None = None
    ) -> None:
        self.inner = inner
        self.init_extra = init_extra or {}
        self.drop = drop

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine({**init_info, **self.init_extra})

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights({k: v for k, v in update_info.items() if k != self.drop})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


# --- a 2-rank trainer whose source all-gathers over the trainer's own default group


def _trainer_rank(rank: int, group_port: int, wt_port: int, client: Any, out: Any) -> None:
    from weight_transfer import ModuleSource

    torch.set_num_threads(1)
    try:
        model, full = dtensor_model(rank, group_port)
        info = NCCLTrainerInitInfo("127.0.0.1", wt_port, 3, rank=rank, timeout_s=30)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=client if rank == 0 else ForbiddenClient(), source=ModuleSource(model)
        )
        engine.send_weights()
        engine.send_weights()
        out.put((rank, "ok", {n: digest(t) for n, t in full.items()}))
        torch.distributed.destroy_process_group()
    except BaseException as e:
        out.put((rank, "err", f"{type(e).__name__}: {e}"))


def test_two_rank_trainer_with_dtensor_source() -> None:
    ctx = mp.get_context("spawn")
    with WorkerPool("nccl", 2) as p:
        p.each("set_names", ["0.weight", "0.bias", "1.weight", "1.bias"])
        out = ctx.Queue()
        group_port, wt_port = free_port(), free_port()
        procs = [
            ctx.Process(target=_trainer_rank, args=(r, group_port, wt_port, p.client(), out))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            results = {}
            for _ in range(2):
                rank, status, payload = out.get(timeout=120)
                results[rank] = (status, payload)
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        assert results[0][0] == "ok", results[0]
        assert results[1][0] == "ok", results[1]
        want = results[0][1]
        for got in p.each("digests"):
            assert got == want


def _doomed_trainer(port: int, client: Any, stall_at: int, stalled: Any) -> None:
    tensors = mixed_tensors(21)
    info = NCCLTrainerInitInfo(
        "127.0.0.1", port, 2, rank=0, timeout_s=60.0,
        packed_buffer_size_bytes=1024, packed_min_bucket_bytes=0,
    )  # fmt: skip
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=StallingSource(tensors, stall_at, stalled)
    )
    engine.send_weights()


@pytest.mark.parametrize("stall_at", [1, 9])
def test_a_killed_trainer_is_noticed_by_the_worker_within_seconds(stall_at: int) -> None:
    """The worker probes the trainer's store while it waits in a collective, so a
    trainer killed mid-round fails the worker's update in about a second, not at
    the transport timeout (60 s here)."""
    tensors = mixed_tensors(21)
    ctx = mp.get_context("spawn")
    with WorkerPool("nccl", 1, names=list(tensors)) as p:
        stalled = ctx.Event()
        trainer = ctx.Process(
            target=_doomed_trainer, args=(free_port(), p.client(), stall_at, stalled), daemon=True
        )
        trainer.start()
        try:
            assert stalled.wait(120), "the trainer did not reach the stall"
            time.sleep(0.5)  # the worker is now waiting in a collective
        finally:
            trainer.kill()
            trainer.join(10)
        t0 = time.monotonic()
        client = p.client(timeout_s=60.0)
        with pytest.raises(WeightSyncRPCError, match=r"no transfer group \(it was torn down after"):
            client.start_weight_update()  # answered once the worker's failed round has ended
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, f"the worker noticed the dead trainer after {elapsed:.1f}s"

        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, timeout_s=30.0)
        fresh = WeightTransferTrainerFactory.trainer_init(
            info, client=p.client(), source=DictSource(tensors)
        )
        fresh.send_weights()
        assert_received(p, tensors)
        fresh.shutdown()
