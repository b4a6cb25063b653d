"""`FanOutClient` with in-process replicas: each a `WorkerSession` around a real engine
(`EchoEngine` over `TinyModel`, core's `DirectLoader` undoing); faults injected at one
replica's client in each phase. Live-server fleets: tests/vllm/test_fleet_http.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.core.helpers import EchoEngine, TinyModel
from weight_transfer import FanOutClient, FleetError, WeightTransferConfig, WorkerSession
from weight_transfer.wire import WIRE_PROTOCOL_VERSION

REPLICAS = 3
INIT = {"wire_protocol": WIRE_PROTOCOL_VERSION, "endpoint": "tcp://127.0.0.1:9"}


class Faulty:
    """A replica's client: forwards to its session; `fault = (phase, how)` makes the next
    call of that phase fail: "raise" before reaching the session, "lost" after it ran."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.fault: tuple[str, str] | None = None

    def _call(self, phase: str, method: str, *args: Any) -> Any:
        fault, self.fault = (self.fault, None) if self.fault and self.fault[0] == phase else (
            None, self.fault)  # fmt: skip
        if fault and fault[1] == "raise":
            raise RuntimeError(f"{phase}: injected failure")
        result = getattr(self.session, method)(*args)
        if fault and fault[1] == "lost":
            raise TimeoutError(f"{phase}: the answer was lost")
        return result

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.session.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._call("start", "start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        phase = "update" if isinstance(update_info, dict) and "names" in update_info else "control"
        self._call(phase, "update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", "finish_weight_update", weight_version)

    @property
    def weight_version(self) -> str | None:
        return self.session.weight_version

    def set_weight_version(self, version: str) -> None:
        self.session.set_weight_version(version)


@pytest.fixture
def fleet() -> tuple[FanOutClient, list[Faulty]]:
    replicas = [
        Faulty(WorkerSession(EchoEngine(WeightTransferConfig("echo"), None, "cpu", TinyModel())))
        for _ in range(REPLICAS)
    ]
    client = FanOutClient(replicas, timeout_s=10.0)
    client.init_weight_transfer_engine(INIT)
    return client, replicas


def sync(client: FanOutClient, value: float, version: str) -> None:
    client.start_weight_update()
    client.update_weights({"names": ["a", "b"], "values": [value, value + 0.5]})
    client.finish_weight_update(version)


def assert_serving(replicas: list[Faulty], value: float, version: str | None) -> None:
    for i, replica in enumerate(replicas):
        model = replica.session.engine.model
        assert torch.equal(model.a, torch.full((3,), value)), f"replica {i}: a"
        assert torch.equal(model.b, torch.full((2, 2), value + 0.5)), f"replica {i}: b"
        assert replica.session.weight_version == version, f"replica {i}: label"
        assert not replica.session.active, f"replica {i} was left in a round"


def test_replicas_move_together(fleet: tuple[FanOutClient, list[Faulty]]) -> None:
    client, replicas = fleet
    sync(client, 1.0, "v1")
    assert_serving(replicas, 1.0, "v1")
    sync(client, 2.0, "v2")
    assert_serving(replicas, 2.0, "v2")


@pytest.mark.parametrize(
    ("phase", "how", "replica"),
    [("start", "raise", 0), ("update", "raise", 1), ("finish", "raise", 2), ("finish", "lost", 1)],
)
def test_a_failure_at_one_replica_leaves_every_replica_on_its_previous_weights_and_label(
    fleet: tuple[FanOutClient, list[Faulty]], phase: str, how: str, replica: int
) -> None:
    client, replicas = fleet
    sync(client, 1.0, "v1")
    replicas[replica].fault = (phase, how)
    with pytest.raises(FleetError) as failed:
        sync(client, 2.0, "never")
    assert (failed.value.phase, failed.value.replica) == (phase, replica)
    assert failed.value.unrecovered == []
    client.round_failed(failed.value)  # as the trainer's round does; waits for the rollback
    assert_serving(replicas, 1.0, "v1")  # a finish whose answer was lost is reverted too
    sync(client, 3.0, "v3")  # the next round moves every replica
    assert_serving(replicas, 3.0, "v3")
