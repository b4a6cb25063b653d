"""In-process pieces for `sharded_rdt` tests over the loopback transport.

`Shards(tp, replicas)` builds `replicas` x `tp` consumers, each a real
`ShardedRDTWorkerEngine` inside a `WorkerSession` around a `ShardedModel`
shard, and a client per replica that calls its workers concurrently (as
vLLM's `collective_rpc` does); `shards.client` is that client, or a
`FanOutClient` over the replicas. Trainer engines are real too, one per
trainer rank, each hosting its producer in this process.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.models import ShardedModel, reference
from weight_transfer import FanOutClient, WeightSource, WorkerPosition, WorkerSession
from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo
from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

CALL_TIMEOUT_S = 60.0
_prefixes = itertools.count()


class ReplicaClient:
    """One replica: every call goes to all its workers at once and waits for all of
    them (as vLLM's `collective_rpc` does); then the first error raises."""

    def __init__(self, sessions: list[WorkerSession]) -> None:
        self.sessions = sessions
        self.pool = concurrent.futures.ThreadPoolExecutor(
            len(sessions), thread_name_prefix="replica"
        )
        self.skip_update: set[int] = set()  # workers whose update_weights is not delivered

    def _all(self, method: str, *args: Any) -> None:
        futures = [
            self.pool.submit(getattr(s, method), *args)
            for i, s in enumerate(self.sessions)
            if not (method == "update_weights" and i in self.skip_update)
        ]
        concurrent.futures.wait(futures, timeout=CALL_TIMEOUT_S)
        for future in futures:
            future.result(0)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)


class Shards:
    def __init__(
        self, tp: int, replicas: int = 1, model_cls: type[ShardedModel] = ShardedModel
    ) -> None:
        self.tp, self.replicas_n = tp, replicas
        self.models = [model_cls(r, tp) for _ in range(replicas) for r in range(tp)]
        self.engines = [
            ShardedRDTWorkerEngine(None, WorkerPosition(i % tp, tp), "cpu", m)
            for i, m in enumerate(self.models)
        ]
        self.sessions = [WorkerSession(e) for e in self.engines]
        self.replicas = [
            ReplicaClient(self.sessions[k * tp : (k + 1) * tp]) for k in range(replicas)
        ]
        self.client: Any = self.replicas[0] if replicas == 1 else FanOutClient(self.replicas)
        self.prefix = f"wt-test-{next(_prefixes)}"

    def info(self, rank: int = 0, **kw: Any) -> ShardedRDTTrainerInitInfo:
        defaults: dict[str, Any] = dict(
            num_consumers=self.tp * self.replicas_n,
            num_replicas=self.replicas_n,
            transport="loopback",
            producer_prefix=self.prefix,
            timeout_s=30.0,
            stall_timeout_s=10.0,
            peer_timeout_s=5.0,
        )
        defaults.update(kw)
        return ShardedRDTTrainerInitInfo(rank=rank, **defaults)

    def trainer(
        self, source: WeightSource, rank: int = 0, client: Any = None, **kw: Any
    ) -> ShardedRDTTrainerEngine:
        return ShardedRDTTrainerEngine.trainer_init(
            self.info(rank, **kw),
            client=client if client is not None else self.client,
            source=source,
        )

    def wait_closed(self) -> None:
        """Until every consumer's round has closed (bounded). A worker whose update
        succeeded while another's failed holds its round open, as a host does after
        a failed sync: its host ends it (the engine rolls it back)."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            busy = [s.engine._busy for s in self.sessions]
            if not any(busy):
                for session in self.sessions:
                    session.abandon_round()
                if not any(s.engine.round_open for s in self.sessions):
                    return
            time.sleep(0.02)
        raise AssertionError("a consumer's round stayed open")

    def assert_serving(self, seed: int, which: list[int] | None = None) -> None:
        """Every (or each listed) consumer holds exactly its shard of `checkpoint(seed)`,
        once its round has closed (after a failed sync, workers roll back on their own)."""
        self.wait_closed()
        for i in which if which is not None else range(len(self.models)):
            want = reference(seed, i % self.tp, self.tp)
            for name, got in self.models[i].state_dict().items():
                assert torch.equal(got, want[name]), (
                    f"consumer {i}: {name} differs from seed {seed}"
                )


@pytest.fixture
def shards() -> Iterator[Any]:
    made: list[Shards] = []

    def make(tp: int, replicas: int = 1, model_cls: type[ShardedModel] = ShardedModel) -> Shards:
        made.append(Shards(tp, replicas, model_cls))
        return made[-1]

    yield make
    for s in made:
        for e in s.engines:
            e.shutdown()
