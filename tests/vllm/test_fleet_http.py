"""Fleet guarantees against two live vLLM API servers on 127.0.0.1 (wt_nccl over gloo).

One trainer hosts a group of 1 + 2 ranks; `FanOutClient.http` reaches the
session's two nccl servers (`servers`; `test_http.py` uses the first too). A
failure is injected at one replica in each phase in turn; afterwards both
must serve tokens equal to a fresh engine loaded from the previous weights,
with the previous version label, and the next sync must move both. Then
a replica is killed (SIGKILL of the process group the session started) and
restarted as a new process on its port, held out of traffic until it has the
trainer's weights (`weight_transfer.vllm.readiness`): it rejoins at the next
sync (the group is re-formed) without the trainer restarting, while the others
keep serving, and serves no request before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults import FaultyReplica
from tests.vllm.conftest import (
    INITIAL_SEED,
    References,
    SwitchSource,
    hf_model,
    require_backend,
)
from tests.vllm.servers import Requests, Server, Traffic
from weight_transfer import (
    FanOutClient,
    FleetError,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from weight_transfer.vllm.readiness import NOT_READY
from wt_kits.group import free_port

HOLD = "weight_transfer.vllm.readiness.hold_until_first_sync"

pytest.importorskip("vllm")
pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPLICAS = 2


class Fleet:
    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        base = FanOutClient.http([s.url for s in self.servers], timeout=120.0)
        self.clients = [FaultyReplica(c) for c in base.replicas]
        self.client = FanOutClient(self.clients, names=base.names, timeout_s=120.0)
        self.source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            _nccl_info(), client=self.client, source=self.source
        )

    def sync(self, seed: int, version: str) -> None:
        self.source.inner = ModuleSource(hf_model(seed))
        self.trainer.send_weights(weight_version=version)

    def assert_serving(self, references: References, seed: int, version: str) -> None:
        expected = references.outputs(seed)
        for i, server in enumerate(self.servers):
            assert server.generate() == expected, f"replica {i} does not serve seed {seed}"
            assert server.weight_version() == version, f"replica {i}"
            assert not self.clients[i].is_paused(), f"replica {i} was left paused"

    def restart(self, i: int, extra_args: tuple[str, ...] = ()) -> None:
        """Kill replica `i` (its server and engine) and start a new process on its port."""
        self.servers[i].restart(wait=False, extra_args=extra_args)

    def stop(self) -> None:
        self.trainer.shutdown()
        for client in self.clients:
            client.close()


def _nccl_info() -> Any:
    from wt_nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        "127.0.0.1",
        free_port(),
        1 + REPLICAS,
        rank=0,
        timeout_s=60.0,
        device="cpu",
        packed_buffer_size_bytes=256 << 10,
        packed_min_bucket_bytes=0,
    )


@pytest.fixture(scope="module")
def fleet(servers: Any) -> Iterator[Fleet]:
    require_backend("nccl")
    f = Fleet(servers("nccl", REPLICAS))
    try:
        yield f
    finally:
        f.stop()


# The traffic runs at replica 1; the finish whose answer is lost is replica 0's.
FAULTS = [("start", "unreachable", 0), ("update", "refused", 1), ("finish", "lost", 0)]


def test_fleet_all_or_nothing_in_every_phase(fleet: Fleet, references: References) -> None:
    fleet.sync(2, "v2")
    fleet.assert_serving(references, 2, "v2")
    with Traffic(fleet.servers[1], max_s=600.0) as traffic:
        for phase, how, replica in FAULTS:
            fleet.clients[replica].fault = (phase, how)
            with pytest.raises(FleetError) as failed:
                fleet.sync(3, f"never-{phase}")
            assert (failed.value.phase, failed.value.replica) == (phase, replica)
            assert failed.value.unrecovered == []
            assert fleet.servers[replica].url in str(failed.value)
            fleet.assert_serving(references, 2, "v2")
            fleet.sync(3, f"v3-after-{phase}")  # the next sync moves both
            fleet.assert_serving(references, 3, f"v3-after-{phase}")
            fleet.sync(2, "v2")
    assert traffic.failures == []
    assert traffic.done >= len(FAULTS), traffic.done


def test_a_restarted_replica_catches_up_at_the_next_sync_and_serves_nothing_before(
    fleet: Fleet, references: References
) -> None:
    """The restarted replica runs with `hold_until_first_sync`: under a steady stream
    of requests, it refuses every one (503, its health too) until the fleet's next
    sync re-admits it, and serves every later one on the synced weights."""
    last = REPLICAS - 1
    fleet.sync(3, "before-restart")
    fleet.restart(last, extra_args=("--middleware", HOLD))
    with pytest.raises(FleetError) as failed:  # the last replica is still starting
        fleet.sync(2, "while-down")
    assert (failed.value.phase, failed.value.replica) == ("start", last)
    for i in range(last):  # the others serve on, on their weights
        assert fleet.servers[i].generate() == references.outputs(3)
        assert fleet.servers[i].weight_version() == "before-restart"
    restarted = fleet.servers[last]
    restarted.wait_ready(held=True)
    health = restarted.http.get("/health")
    assert health.status_code == 503 and NOT_READY in health.text
    with Requests(restarted) as requests:
        requests.wait(lambda: requests.refused > 0)
        started = time.monotonic()
        fleet.sync(2, "after-restart")  # re-forms the group, then moves both
        print(f"sync with re-formed group: {time.monotonic() - started:.1f}s")
        requests.wait(lambda: len(requests.served) > 0)
    assert requests.failures == []
    assert requests.refused > 0 and requests.served, (requests.refused, len(requests.served))
    assert all(served == references.outputs(2) for served in requests.served)
    assert restarted.http.get("/health").status_code == 200
    read = time.monotonic()
    assert fleet.client.weight_versions() == ["after-restart"] * REPLICAS
    assert time.monotonic() - read < 5.0  # every replica answers its control reads at once
    fleet.assert_serving(references, 2, "after-restart")
    fleet.sync(3, "steady")
    fleet.assert_serving(references, 3, "steady")
