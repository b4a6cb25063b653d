"""`FanOutClient` with in-process replicas: each a `WorkerSession` around a real engine
(`EchoEngine` over `TinyModel`, core's `DirectLoader` undoing); faults injected at one
replica's client in each phase (`tests.faults.FaultyReplica`). Live-server fleets:
tests/vllm/test_fleet_http.py."""

from __future__ import annotations

import pytest
import torch

from tests.core.helpers import EchoEngine, TinyModel
from tests.faults import FaultyReplica
from weight_transfer import FanOutClient, FleetError, WeightTransferConfig, WorkerSession
from weight_transfer.payload import WIRE_PROTOCOL_VERSION

REPLICAS = 3
INIT = {"wire_protocol": WIRE_PROTOCOL_VERSION, "endpoint": "tcp://127.0.0.1:9"}


@pytest.fixture
def fleet() -> tuple[FanOutClient, list[FaultyReplica]]:
    replicas = [
        FaultyReplica(
            WorkerSession(EchoEngine(WeightTransferConfig("echo"), None, "cpu", TinyModel()))
        )
        for _ in range(REPLICAS)
    ]
    client = FanOutClient(replicas, timeout_s=10.0)
    client.init_weight_transfer_engine(INIT)
    return client, replicas


def sync(client: FanOutClient, value: float, version: str) -> None:
    client.start_weight_update()
    client.update_weights({"names": ["a", "b"], "values": [value, value + 0.5]})
    client.finish_weight_update(version)


def assert_serving(replicas: list[FaultyReplica], value: float, version: str | None) -> None:
    for i, replica in enumerate(replicas):
        model = replica.inner.engine.model
        assert torch.equal(model.a, torch.full((3,), value)), f"replica {i}: a"
        assert torch.equal(model.b, torch.full((2, 2), value + 0.5)), f"replica {i}: b"
        assert replica.inner.weight_version == version, f"replica {i}: label"
        assert not replica.inner.active, f"replica {i} was left in a round"


def test_replicas_move_together(fleet: tuple[FanOutClient, list[FaultyReplica]]) -> None:
    client, replicas = fleet
    sync(client, 1.0, "v1")
    assert_serving(replicas, 1.0, "v1")
    sync(client, 2.0, "v2")
    assert_serving(replicas, 2.0, "v2")


@pytest.mark.parametrize(
    ("phase", "how", "replica"),
    [
        ("start", "unreachable", 0),
        ("update", "refused", 1),
        ("finish", "unreachable", 2),
        ("finish", "lost", 1),
    ],
)
def test_a_failure_at_one_replica_leaves_every_replica_on_its_previous_weights_and_label(
    fleet: tuple[FanOutClient, list[FaultyReplica]], phase: str, how: str, replica: int
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


def test_shutting_the_fleet_down_disconnects_every_replica(
    fleet: tuple[FanOutClient, list[FaultyReplica]],
) -> None:
    client, replicas = fleet
    sync(client, 1.0, "v1")
    client.shutdown_weight_transfer_engine()
    for i, replica in enumerate(replicas):
        assert replica.inner.engine.calls[-1] == "shutdown", f"replica {i}"
        with pytest.raises(Exception, match="no_connection"):  # a start needs a new init
            replica.inner.start_weight_update()
    assert_serving(replicas, 1.0, "v1")
