"""`sparse_nccl` with verified bytes (`verify=True`): every wire group is followed by the
digests of its members, which each worker checks before it applies anything. Workers
are `WorkerPool` processes; a byte is flipped in transit through core's test-only
receive hook (`weight_transfer.testing.seams`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
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
from tests.harness import WorkerPool
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from wt_kits.group import free_port
from wt_sparse_nccl import SparseNCCLTrainerEngine, SparseNCCLTrainerInitInfo, SparseWeightPatch
from wt_sparse_nccl.wire import update_info_of, wire_groups

WORKERS = 2
W0, B1, BF16, FP16 = "layers.0.weight", "layers.1.bias", "mixed.bf16_weight", "mixed.fp16_weight"


@dataclass
class Rig:
    pool: WorkerPool
    client: CountingClient
    engine: SparseNCCLTrainerEngine

    def states(self) -> list[dict[str, torch.Tensor]]:
        return self.pool.each("state_dict")

    def assert_state(self, want: dict[str, torch.Tensor]) -> None:
        for got in self.states():
            assert_same_bits(got, want)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with WorkerPool("sparse_nccl", WORKERS, model_factory=MODEL_FACTORY) as pool:
        client = CountingClient(pool.client(timeout_s=60.0))
        info = SparseNCCLTrainerInitInfo(
            "127.0.0.1", free_port(), 1 + WORKERS, rank=0, timeout_s=30.0, device="cpu",
            verify=True,
        )  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
        assert isinstance(engine, SparseNCCLTrainerEngine)
        yield Rig(pool, client, engine)
        engine.shutdown()


def batch(state: dict[str, torch.Tensor], gen: torch.Generator) -> list[SparseWeightPatch]:
    """Four dtypes, both index dtypes, odd byte counts (bf16 and fp16 values: tail bytes)."""
    return [
        random_patch(W0, state, 21, gen, index_dtype=torch.int32, specials=True),
        random_patch(B1, state, 3, gen),
        random_patch(BF16, state, 9, gen, index_dtype=torch.int32, specials=True),
        random_patch(FP16, state, 7, gen),
    ]


def test_verified_rounds_are_bit_exact(rig: Rig) -> None:
    gen = torch.Generator().manual_seed(1)
    state = rig.states()[0]
    for round_ in range(3):
        patches = batch(state, gen)
        rig.engine.send_weights(patches, weight_version=f"v{round_}")
        state = applied(state, patches)
        rig.assert_state(state)


def target(patches: list[SparseWeightPatch], kind: str, patch: int, last: bool) -> tuple[int, int]:
    """(wire group, byte in it): the first or last byte of patch `patch`'s `kind`."""
    for k, group in enumerate(wire_groups(update_info_of(patches), aligned=True)):
        if group.kind == kind and patch in group.members:
            j = group.members.index(patch)
            size = group.counts[j] * group.dtype.itemsize
            return k, group.offsets[j] + (size - 1 if last else 0)
    raise AssertionError(f"no wire group holds the {kind} of patch {patch}")


CORRUPTIONS = {
    "first index byte": ("indices", 0, False),
    "a value's last byte": ("values", 1, True),
    "a bf16 tail byte": ("values", 2, True),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_byte_flipped_in_transit_refuses_the_round_naming_the_patch(rig: Rig, case: str) -> None:
    gen = torch.Generator().manual_seed(2)
    state = rig.states()[0]
    group = rig.engine.channel.require()
    patches = batch(state, gen)
    kind, index, last = CORRUPTIONS[case]
    k, at = target(patches, kind, index, last)
    rig.pool.on(1, "corrupt", k, at)
    try:
        with pytest.raises(WeightSyncRPCError) as refused:
            rig.engine.send_weights(patches, weight_version="never")
    finally:
        rig.pool.on(1, "corrupt", None)
    message = str(refused.value)
    assert "worker 1" in message
    assert f"the {kind} of patch {index} ({patches[index].name!r}) arrived different" in message
    assert_same_bits(rig.states()[1], state)  # nothing applied there
    # Worker 0 received every byte intact; the trainer's failed round aborts its round
    # in band (from a daemon thread), which rolls it back too.
    deadline = time.monotonic() + 10
    while True:
        try:
            rig.assert_state(state)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert rig.engine.channel.group is group  # the wire stayed in step

    rig.client.calls.clear()
    rig.engine.send_weights(patches, weight_version="after")
    assert "init_weight_transfer_engine" not in rig.client.methods()
    rig.assert_state(applied(state, patches))


def test_a_mismatched_update_info_is_refused_with_the_digests_drained(rig: Rig) -> None:
    """Under verify the drained batch includes each wire group's digests."""
    gen = torch.Generator().manual_seed(3)
    state = rig.states()[0]
    patches = batch(state, gen)

    def fewer(payload: dict[str, Any]) -> dict[str, Any]:
        counts = list(payload["num_updates"])
        counts[0] -= 1
        return {**payload, "num_updates": counts}

    rig.client.key = rig.engine.client.control
    rig.client.rewrite = fewer
    try:
        with pytest.raises(WeightSyncRPCError, match="field 'num_updates' differs"):
            rig.engine.send_weights(patches)
    finally:
        rig.client.rewrite = None
    assert all(p.is_alive() for p in rig.pool.processes)
    rig.assert_state(state)
    rig.engine.send_weights(patches)
    rig.assert_state(applied(state, patches))
