"""`sparse_nccl` behind an all-or-nothing `FanOutClient`, over real gloo groups.

In process: three replicas, each a `WorkerSession` around a `SparseNCCLWorkerEngine`
holding a `PatchableModel` (its `InPlacePatcher` is the round's `Revertible`
transaction). A fault is injected at one replica per phase; afterwards every
replica holds the previous weights bit-exactly with the previous label, and the
next round moves all three (re-forming the group if the failure tore it down).

In worker processes: two replicas, one killed and restarted between rounds;
the next round re-admits it (`Refusal.NO_CONNECTION`, then `reconnect`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.sparse_nccl.helpers import (
    MODEL_FACTORY,
    CountingClient,
    applied,
    assert_same_bits,
    random_patch,
)
from tests.backends.sparse_nccl.models import initial_state, make_model
from tests.faults import FaultyReplica
from tests.harness import WorkerPool
from weight_transfer import (
    FanOutClient,
    FleetError,
    WeightTransferTrainerFactory,
    WorkerPosition,
    WorkerSession,
)
from wt_kits.group import free_port
from wt_sparse_nccl import SparseNCCLTrainerEngine, SparseNCCLTrainerInitInfo, SparseWeightPatch
from wt_sparse_nccl.worker import SparseNCCLWorkerEngine

REPLICAS = 3
W0, B1, BF16, FP16 = "layers.0.weight", "layers.1.bias", "mixed.bf16_weight", "mixed.fp16_weight"


def connect(client: Any, workers: int, timeout_s: float = 30.0) -> SparseNCCLTrainerEngine:
    info = SparseNCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + workers, rank=0, timeout_s=timeout_s, device="cpu"
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    assert isinstance(engine, SparseNCCLTrainerEngine)
    return engine


class Fleet:
    """Three in-process replicas behind one `FanOutClient`, and the state they should hold."""

    def __init__(self) -> None:
        self.models = [make_model() for _ in range(REPLICAS)]
        self.sessions = [
            WorkerSession(SparseNCCLWorkerEngine(None, WorkerPosition(0, 1), "cpu", m))
            for m in self.models
        ]
        self.clients = [FaultyReplica(s) for s in self.sessions]
        # A short transport timeout: an aborted group with a send in flight stalls its
        # collection until then (docs/ARCHITECTURE.md, open work).
        self.trainer = connect(FanOutClient(self.clients, timeout_s=60.0), REPLICAS, 10.0)
        self.state = initial_state()
        self.generator = torch.Generator().manual_seed(11)

    def patches(self) -> list[SparseWeightPatch]:
        g, s = self.generator, self.state
        return [
            random_patch(W0, s, 20, g, index_dtype=torch.int32, specials=True),
            random_patch(B1, s, 3, g),
            random_patch(BF16, s, 9, g, index_dtype=torch.int32),
            random_patch(FP16, s, 7, g),
        ]

    def sync(self, version: str) -> None:
        """One round; on success `state` is what every replica should now hold."""
        patches = self.patches()
        self.trainer.send_weights(patches, weight_version=version)
        self.state = applied(self.state, patches)

    def assert_all(self, version: str | None) -> None:
        for r, (model, session) in enumerate(zip(self.models, self.sessions, strict=True)):
            got = {n: p.detach() for n, p in model.named_parameters()}
            assert_same_bits(got, self.state)
            assert session.weight_version == version, f"replica {r}"
            assert not session.active, f"replica {r} still has a round open"
            assert session.engine.held is None, f"replica {r} still holds an undo record"


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    for session in f.sessions:  # workers first: their groups end before the trainer's
        session.engine.shutdown()
    f.trainer.shutdown()
    gc.collect()  # aborted groups' destructors wait here, not in the next test's rendezvous


def test_three_replicas_move_together_and_release_their_records(fleet: Fleet) -> None:
    fleet.sync("v1")
    fleet.assert_all("v1")
    fleet.sync("v2")
    fleet.assert_all("v2")


FAULTS = [
    ("update", "refused"),  # the replica refuses before touching the wire: the group is re-formed
    ("update", "unreachable"),
    ("finish", "unreachable"),
    ("finish", "lost"),  # it committed and held; the fleet reverts it too
]


@pytest.mark.parametrize("replica", [0, 2])
@pytest.mark.parametrize(("phase", "how"), FAULTS)
def test_a_fault_at_one_replica_keeps_every_replica_on_the_previous_weights(
    fleet: Fleet, phase: str, how: str, replica: int
) -> None:
    fleet.sync("v1")
    before = fleet.state
    fleet.clients[replica].fault = (phase, how)
    with pytest.raises(FleetError) as failed:
        fleet.sync("v2")
    assert (failed.value.phase, failed.value.replica) == (phase, replica)
    assert failed.value.unrecovered == []
    assert fleet.state is before
    fleet.assert_all("v1")  # bit-exact, on every replica, reverted ones included
    fleet.sync("v3")
    fleet.assert_all("v3")


class Slot:
    """A replica's client that a test can point at a restarted process (same replica)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_killed_and_restarted_replica_is_re_admitted_at_the_next_round() -> None:
    gen = torch.Generator().manual_seed(5)
    base = initial_state()
    with (
        WorkerPool("sparse_nccl", 1, model_factory=MODEL_FACTORY) as first,
        WorkerPool("sparse_nccl", 1, model_factory=MODEL_FACTORY) as second,
    ):
        slots = [CountingClient(Slot(pool.client(timeout_s=60.0))) for pool in (first, second)]
        trainer = connect(FanOutClient(slots, timeout_s=60.0), 2)
        one = [random_patch(W0, base, 30, gen), random_patch(BF16, base, 5, gen)]
        trainer.send_weights(one, weight_version="v1")
        for pool in (first, second):
            assert_same_bits(pool.on(0, "state_dict"), applied(base, one))

        second.kill(0)
        with WorkerPool("sparse_nccl", 1, model_factory=MODEL_FACTORY) as restarted:
            slots[1].inner.inner = restarted.client(timeout_s=60.0)
            for slot in slots:
                slot.calls.clear()
            two = [random_patch(W0, base, 30, gen), random_patch(FP16, base, 4, gen)]
            trainer.send_weights(two, weight_version="v2")

            # The restarted replica refused the start (no group), so the trainer
            # re-formed the group with both replicas and started again.
            for slot in slots:
                assert slot.methods().count("init_weight_transfer_engine") == 1
                assert slot.methods()[-1] == "finish_weight_update"
            assert_same_bits(first.on(0, "state_dict"), applied(base, [*one, *two]))
            # A delta round lands on the weights the restarted process loaded itself.
            assert_same_bits(restarted.on(0, "state_dict"), applied(base, two))
            assert [p.on(0, "weight_version") for p in (first, restarted)] == ["v2", "v2"]

            three = [random_patch(B1, base, 2, gen)]
            trainer.send_weights(three, weight_version="v3")  # no new handshake
            assert all(s.methods().count("init_weight_transfer_engine") == 1 for s in slots)
            assert_same_bits(restarted.on(0, "state_dict"), applied(base, [*two, *three]))
            trainer.shutdown()
