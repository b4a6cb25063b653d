"""The data plane's cost per warm round, counted deterministically (no timing).

One warm round of 1,000 and of 8,000 small tensors, nccl and ipc, one worker
(sharded_rdt's counts, per gather group and per producer, are in its loopback
tests). Counted on the trainer and in the worker process, on every thread:

- control-plane calls (`CountedClient`): a constant, the same for both sizes;
- wire messages (`WireCalls`): nccl, exactly one broadcast per bucket plus the
  round header and layout on each side; ipc, one `READY` frame per bucket plus a
  constant;
- host reads (`HostSyncs`): at most one per bucket on each side, plus the round
  header's two in an nccl worker;
- on the trainer's thread (`AtenOps`): at most 4 aten ops per tensor, exactly
  one byte copied per byte sent (the pack; nccl adds a 16-byte status tail per
  bucket), and no allocation but the finite check's (one norm per run of one
  dtype: these tensors alternate dtypes, the worst case; on CPU each norm is a
  tensor of its own, on a GPU one per dtype and bucket);
- in the worker's unpacking (`AtenOps` around `Unpacker.unpack`, on the thread
  that receives): one call per bucket, no aten op, nothing copied or allocated
  (the views of each bucket were made in the cold round). A tensor split
  across buckets would be the exception: its pieces are copied into a tensor
  allocated for it each round, which the worker does not keep between rounds.

sparse_nccl, a round of 1,000 and of 8,000 patches: its index checks (range,
uniqueness) run batched, so host syncs stay a constant per batch on both sides.
On a GPU every host sync stalls the pipeline until the device drains, and
every message and allocation is a launch: these counts are its speed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from wt_tools.counting import AtenOps, CountedClient, HostSyncs, WireCalls

from tests.harness import WorkerPool, assert_received
from tests.sources import DictSource
from weight_transfer import WeightTransferTrainerFactory
from wt_kits.group.stateless import free_port

SIZES = (1000, 8000)
BUFFER_BYTES = 16 << 10
MAX_TRAINER_OPS_PER_TENSOR = 4
MAX_SPARSE_SYNCS = 4  # per batch and side, whatever its number of patches


def small_tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    """`n` tensors of 8-tensor layers, float32 and bfloat16 alternating."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(n):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        shape = (4, 8) if i % 3 else (32,)
        tensors[f"layers.{i // 8}.w{i % 8}"] = torch.randn(shape, generator=g).to(dtype)
    return tensors


def _nccl(client: Any, source: DictSource) -> Any:
    from wt_nccl import NCCLTrainerInitInfo

    info = NCCLTrainerInitInfo(
        "127.0.0.1",
        free_port(),
        2,
        rank=0,
        packed_buffer_size_bytes=BUFFER_BYTES,
        timeout_s=60.0,
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _ipc(client: Any, source: DictSource) -> Any:
    from wt_ipc import IPCTrainerInitInfo

    info = IPCTrainerInitInfo(
        rank=0, packed_buffer_size_bytes=BUFFER_BYTES, packed_num_buffers=2, timeout_s=60.0
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


CONNECT = {"nccl": _nccl, "ipc": _ipc}


def warm_round(pool: WorkerPool, backend: str, n: int) -> dict[str, Any]:
    """Counts of the second round of `n` tensors (the first plans and allocates)."""
    tensors = small_tensors(n, seed=n)
    source = DictSource(tensors)
    pool.each("set_names", list(tensors))
    client = CountedClient(pool.client())
    engine = CONNECT[backend](client, source)
    try:
        engine.send_weights()  # cold: plans, buffers, views
        source.tensors = tensors = small_tensors(n, seed=n + 1)
        plan = engine.plan_for(source.metadata())
        client.counts.clear()
        pool.each("count_costs")
        with HostSyncs() as syncs, WireCalls() as wire, AtenOps() as ops:
            engine.send_weights()
        (worker,) = pool.each("costs")
        rpcs = dict(client.counts)
        engine.check_finite = False
        with AtenOps() as unchecked:
            engine.send_weights()
    finally:
        engine.shutdown()
    assert_received(pool, tensors)
    return {
        "buckets": len(plan.buckets),
        "bytes": plan.total_bytes,
        "rpcs": rpcs,
        "trainer_syncs": syncs.total,
        "trainer_wire": wire.total,
        "trainer_ops": ops.total,
        "copied": ops.copied_bytes,
        "finite_check_allocations": sum(ops.allocations.values()),
        "unchecked_copied": unchecked.copied_bytes,
        "unchecked_allocations": dict(unchecked.allocations),
        "worker_syncs": sum(worker["host_syncs"].values()),
        "worker_wire": sum(worker["wire"].values()),
        "worker_unpack": worker["unpack"],
    }


@pytest.mark.parametrize("backend", list(CONNECT))
def test_a_warm_round_costs_a_constant_per_round_and_per_bucket_not_per_tensor(
    backend: str,
) -> None:
    with WorkerPool(backend, 1) as pool:
        counts = {n: warm_round(pool, backend, n) for n in SIZES}
    one_round = {"start_weight_update": 1, "update_weights": 2, "finish_weight_update": 1}
    assert all(c["rpcs"] == one_round for c in counts.values()), counts  # the layout, the seal
    for n, c in counts.items():
        buckets = c["buckets"]
        where = f"{backend}, {n} tensors in {buckets} buckets: {c}"
        if backend == "nccl":  # the round header and layout, then one broadcast per bucket
            assert c["trainer_wire"] == c["worker_wire"] == 2 + buckets, where
            assert c["worker_syncs"] <= 2 + buckets, where
        else:  # a READY frame per bucket
            assert buckets <= c["trainer_wire"] <= buckets + 4, where
            assert c["worker_syncs"] <= buckets, where
        assert c["trainer_syncs"] <= buckets, where
        assert c["trainer_ops"] <= MAX_TRAINER_OPS_PER_TENSOR * n, where
        tails = 16 * buckets if backend == "nccl" else 0  # the status tails
        assert c["copied"] == c["unchecked_copied"] == c["bytes"] + tails, where  # the pack
        assert c["unchecked_allocations"] == {}, where
        # the worker's unpacking: views it made in the cold round, nothing copied or allocated
        assert c["worker_unpack"] == {
            "copied_bytes": 0, "allocations": 0, "ops": 0, "buckets": buckets
        }, where  # fmt: skip


SPARSE_MODEL = "tests.backends.test_counted_costs:many_parameters"


def many_parameters() -> torch.nn.Module:
    """8,000 small float32 parameters `layers.<i>.w` (a worker's model for sparse_nccl)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(max(SIZES)):
        layer = torch.nn.Module()
        layer.register_parameter("w", torch.nn.Parameter(torch.zeros(32), requires_grad=False))
        model.layers.append(layer)
    return model


def test_a_sparse_batch_costs_host_syncs_per_batch_not_per_patch() -> None:
    from wt_sparse_nccl import SparseNCCLTrainerInitInfo, SparseWeightPatch

    g = torch.Generator().manual_seed(3)
    with WorkerPool("sparse_nccl", 1, model_factory=SPARSE_MODEL) as pool:
        info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, timeout_s=60.0)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=pool.client())
        try:
            for n in SIZES:
                patches = [
                    SparseWeightPatch(
                        f"layers.{i}.w",
                        torch.randperm(32, generator=g)[:4],
                        torch.randn(4, generator=g),
                        (32,),
                    )
                    for i in range(n)
                ]
                engine.send_weights(patches[:8])  # cold
                pool.each("count_costs")
                with HostSyncs() as trainer_syncs:
                    engine.send_weights(patches)
                (worker,) = pool.each("costs")
                worker_syncs = worker["host_syncs"]
                (state,) = pool.each("state_dict")
                for patch in patches:  # every entry landed where its patch says
                    got = state[patch.name].view(-1)[patch.indices]
                    assert torch.equal(got, patch.values), patch.name
                where = f"sparse_nccl, {n} patches"
                assert trainer_syncs.total <= MAX_SPARSE_SYNCS, (
                    f"{where}: the trainer made {dict(trainer_syncs.counts)} host syncs"
                )
                assert sum(worker_syncs.values()) <= MAX_SPARSE_SYNCS, (
                    f"{where}: the worker made {worker_syncs} host syncs"
                )
        finally:
            engine.shutdown()
