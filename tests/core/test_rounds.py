"""Core's trainer round: the sender's client, `TrainerRound`, `ResyncTrainerEngine`.

The workers here are a `WorkerSession` over a real engine in this process,
behind a client that can delay or fail its answers; the transfer is the
engine's own (a shared dict standing in for the wire).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from tests.core.helpers import ExampleNet, LoadingNet
from weight_transfer import ModuleSource, WeightTransferConfig, WorkerSession
from weight_transfer.backend import (
    AlignedFailure,
    ParamListUpdateInfo,
    ParamMeta,
    ResyncTrainerEngine,
    TrainerInitInfo,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
)
from weight_transfer.runtime.control import SEAL_FIELD
from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks
from weight_transfer.runtime.round_client import RoundClient


@dataclass
class MemoryInitInfo(WeightTransferInitInfo):
    pass


class MemoryWorker(WeightTransferEngine[MemoryInitInfo, ParamListUpdateInfo]):
    """Waits (at most 2 s) for each declared tensor to appear in `wire`, then loads the batch."""

    init_info_cls = MemoryInitInfo
    update_info_cls = ParamListUpdateInfo
    wire: dict[str, torch.Tensor]

    def init_transfer_engine(self, init_info: MemoryInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: ParamListUpdateInfo) -> None:
        batch = []
        for meta in update_info.metas:
            deadline = time.monotonic() + 2
            while meta.name not in self.wire:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{meta.name} never arrived")
                time.sleep(0.001)
            batch.append((meta.name, self.wire.pop(meta.name)))
        self.loader.load(batch)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@dataclass
class MemoryTrainerInfo(TrainerInitInfo):
    backend: ClassVar[str] = "memory"


class MemoryTrainer(ResyncTrainerEngine[MemoryTrainerInfo]):
    init_info_cls = MemoryTrainerInfo
    wire: dict[str, torch.Tensor]

    @classmethod
    def trainer_init(
        cls,
        init_info: MemoryTrainerInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> MemoryTrainer:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, timeout_s=10)
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({})
        return engine

    def transmit(
        self,
        metas: list[ParamMeta],
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        transfer: Transfer,
    ) -> None:
        for meta, tensor in pairs:
            self.wire[meta.name] = tensor.detach().clone()
            transfer.chunk_moved(meta.nbytes)


class Answering:
    """A client over a `WorkerSession` whose `update_weights` answers `delay_s` late."""

    def __init__(self, session: WorkerSession, delay_s: float = 0.0) -> None:
        self.session = session
        self.delay_s = delay_s
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")
        self.session.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.session.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")
        try:
            self.session.update_weights(update_info)
        finally:
            time.sleep(self.delay_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.session.finish_weight_update(weight_version)


def _rig(
    delay_s: float = 0.0, trainer_cls: type[MemoryTrainer] = MemoryTrainer, rank: int = 0
) -> tuple[MemoryTrainer, Answering, LoadingNet]:
    """A trainer and one in-process worker sharing a fresh `wire`."""
    model = LoadingNet()
    worker = MemoryWorker(WeightTransferConfig("memory"), None, "cpu", model)
    client = Answering(WorkerSession(worker), delay_s)
    trainer = trainer_cls.trainer_init(
        MemoryTrainerInfo(rank=rank), client=client, source=ModuleSource(ExampleNet(seed=0))
    )  # each test sets the source it sends
    assert isinstance(trainer, MemoryTrainer)
    trainer.wire = worker.wire = {}
    return trainer, client, model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bit-equal parameters, by name."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return list(pa) == list(pb) and all(
        pa[n].dtype == pb[n].dtype
        and torch.equal(pa[n].detach().view(torch.uint8), pb[n].detach().view(torch.uint8))
        for n in pa
    )


def test_the_round_transmits_while_update_weights_is_in_flight() -> None:
    trainer, client, model = _rig()
    target = ExampleNet(seed=3)
    trainer.source = ModuleSource(target)
    trainer.send_weights(weight_version="v1")
    assert client.calls == ["init", "start", "update", "update", "finish"]  # 2nd: the seal
    assert _same(model, target)
    assert client.session.weight_version == "v1"


class Broken(WeightSource):
    """Yields the first parameter, then raises (a gather that failed)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return ModuleSource(self.module).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        first = next(iter(ModuleSource(self.module)))
        yield first
        raise RuntimeError("the gather of layer 1 failed")


def test_a_source_error_surfaces_at_once_though_the_workers_answer_late() -> None:
    trainer, client, model = _rig(delay_s=3.0)
    trainer.source = Broken(ExampleNet(seed=4))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the gather of layer 1 failed"):
        trainer.send_weights()
    assert time.monotonic() - t0 < 2.0  # not the workers' late answer, not the timeout
    # the worker times out waiting for the rest and rolls back; the next round
    # first lets that call end, then works
    client.delay_s = 0.0
    trainer.source = ModuleSource(target := ExampleNet(seed=5))
    trainer.send_weights()
    assert _same(model, target)


def test_an_aligned_failure_raises_its_cause_and_waits_on_nothing() -> None:
    class Abandoning(MemoryTrainer):
        def transmit(self, metas: Any, pairs: Any, transfer: Transfer) -> None:
            raise AlignedFailure(ValueError("source disagrees with metadata at 'x'"))

    trainer, _, _ = _rig(trainer_cls=Abandoning)
    trainer.source = ModuleSource(ExampleNet(seed=6))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="disagrees with metadata at 'x'"):
        trainer.send_weights()
    assert time.monotonic() - t0 < 2.0


def test_round_client_waits_for_the_update_before_finish_and_raises_its_error() -> None:
    gate = threading.Event()

    class Slow:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

        def start_weight_update(self) -> None:
            self.calls.append("start")

        def update_weights(self, update_info: Any) -> None:
            if SEAL_FIELD in update_info:
                self.calls.append("seal")
                return
            gate.wait(5)
            self.calls.append("update")
            raise KeyError("worker 0: no parameter named 'z'")

        def finish_weight_update(self) -> None:  # the documented shape: no version argument
            self.calls.append("finish")

    inner = Slow()
    client = RoundClient(inner, timeout_s=10)
    client.start_weight_update()
    client.update_weights({"names": []})
    assert inner.calls == ["start"]  # returned while the call is in flight
    gate.set()
    with pytest.raises(KeyError, match="no parameter named 'z'"):
        client.finish_weight_update()
    assert inner.calls == ["start", "update"]
    client.finish_weight_update()
    assert inner.calls == ["start", "update", "seal", "finish"]


def test_non_sender_ranks_iterate_and_call_nothing() -> None:
    class Counting(ModuleSource):
        passes = 0

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            Counting.passes += 1
            return super().__iter__()

    trainer, client, _ = _rig(rank=1)
    trainer.source = Counting(ExampleNet(seed=1))
    trainer.send_weights()
    assert client.calls == [] and Counting.passes == 1


def test_round_hooks_report_start_chunks_and_the_end() -> None:
    events: list[tuple[str, Any]] = []

    class Recorder:
        @hookimpl
        def wt_sync_started(self, backend: str, sync_id: int) -> None:
            events.append(("started", (backend, sync_id)))

        @hookimpl
        def wt_chunk_moved(self, index: int, num_chunks: int) -> None:
            events.append(("chunk", (index, num_chunks)))

        @hookimpl
        def wt_sync_finished(self, weight_version: str | None) -> None:
            events.append(("finished", weight_version))

        @hookimpl
        def wt_sync_failed(self, error: BaseException) -> None:
            events.append(("failed", str(error)))

    recorder = Recorder()
    register_hooks(recorder)
    try:
        trainer, _, _ = _rig()
        trainer.source = ModuleSource(ExampleNet(seed=2))
        trainer.send_weights(weight_version="h1")
        n = len(trainer.source.metadata())
        assert events[0] == ("started", ("memory", 1))
        assert [e for e in events if e[0] == "chunk"] == [("chunk", (i, n)) for i in range(n)]
        assert events[-1] == ("finished", "h1")
        events.clear()
        trainer.source = Broken(ExampleNet(seed=2))
        with pytest.raises(RuntimeError):
            trainer.send_weights()
        assert events[0] == ("started", ("memory", 2))
        assert events[-1] == ("failed", "the gather of layer 1 failed")
    finally:
        plugin_manager().unregister(recorder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_unless_allowed(bad: float) -> None:
    trainer, _, model = _rig()
    target = ExampleNet(seed=9)
    with torch.no_grad():
        target.layers[1].weight[0, 3] = bad  # a bfloat16 layer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.source = ModuleSource(target)
    with pytest.raises(ValueError, match=r"non-finite values .* in 'layers\.1\.weight'"):
        trainer.send_weights()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    trainer.check_finite = False
    trainer.send_weights()
    assert _same(model, target)
