"""The data plane's cost per tensor, counted deterministically (no timing).

One warm round of 1,000 and of 8,000 small tensors, nccl and ipc (sharded_rdt's
count, per gather group, is in its loopback tests): the host syncs
(`wt_tools.counting.HostSyncs`) on the trainer and in each worker process must
not grow with the tensor count (at most 2 per bucket), and the trainer
thread's aten ops stay at most 4 per tensor. sparse_nccl, a round of 1,000 and
of 8,000 patches: its index checks (range, uniqueness) run batched, so host
syncs stay a constant per batch on both sides. On a GPU every host sync stalls
the pipeline until the device drains, so these counts are its speed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from wt_tools.counting import AtenOps, HostSyncs

from tests.harness import WorkerPool, assert_received
from tests.sources import DictSource
from weight_transfer import WeightTransferTrainerFactory
from wt_kits.group.stateless import free_port

SIZES = (1000, 8000)
BUFFER_BYTES = 256 << 10
MAX_SYNCS_PER_BUCKET = 2
MAX_TRAINER_OPS_PER_TENSOR = 4


def small_tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    """`n` tensors of 8-tensor layers, float32 and bfloat16 alternating."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(n):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        shape = (4, 8) if i % 3 else (32,)
        tensors[f"layers.{i // 8}.w{i % 8}"] = torch.randn(shape, generator=g).to(dtype)
    return tensors


def _nccl(pool: WorkerPool, source: DictSource) -> Any:
    from wt_nccl import NCCLTrainerInitInfo

    info = NCCLTrainerInitInfo(
        "127.0.0.1",
        free_port(),
        2,
        rank=0,
        packed_buffer_size_bytes=BUFFER_BYTES,
        timeout_s=60.0,
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=pool.client(), source=source)


def _ipc(pool: WorkerPool, source: DictSource) -> Any:
    from wt_ipc import IPCTrainerInitInfo

    info = IPCTrainerInitInfo(
        rank=0, packed_buffer_size_bytes=BUFFER_BYTES, packed_num_buffers=2, timeout_s=60.0
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=pool.client(), source=source)


CONNECT = {"nccl": _nccl, "ipc": _ipc}


@pytest.mark.parametrize("backend", list(CONNECT))
def test_a_warm_round_costs_host_syncs_per_bucket_not_per_tensor(backend: str) -> None:
    with WorkerPool(backend, 1) as pool:
        for n in SIZES:
            tensors = small_tensors(n, seed=n)
            source = DictSource(tensors)
            pool.each("set_names", list(tensors))
            engine = CONNECT[backend](pool, source)
            try:
                engine.send_weights()  # cold: plans, buffers, views
                source.tensors = tensors = small_tensors(n, seed=n + 1)
                buckets = len(engine.plan_for(source.metadata()).buckets)
                pool.each("count_host_syncs")
                with HostSyncs() as trainer_syncs, AtenOps() as trainer_ops:
                    engine.send_weights()
                (worker_syncs,) = pool.each("host_syncs")
            finally:
                engine.shutdown()
            assert_received(pool, tensors)
            where = f"{backend}, {n} tensors in {buckets} buckets"
            assert trainer_syncs.total <= MAX_SYNCS_PER_BUCKET * buckets, (
                f"{where}: the trainer made {dict(trainer_syncs.counts)} host syncs"
            )
            assert sum(worker_syncs.values()) <= MAX_SYNCS_PER_BUCKET * buckets, (
                f"{where}: the worker made {worker_syncs} host syncs"
            )
            assert trainer_ops.total <= MAX_TRAINER_OPS_PER_TENSOR * n, (
                f"{where}: the trainer thread ran {trainer_ops.total} aten ops: "
                f"{trainer_ops.counts.most_common(6)}"
            )


SPARSE_MODEL = "tests.backends.test_host_syncs:many_parameters"
MAX_SPARSE_SYNCS = 4  # per batch and side, whatever its number of patches


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
                pool.each("count_host_syncs")
                with HostSyncs() as trainer_syncs:
                    engine.send_weights(patches)
                (worker_syncs,) = pool.each("host_syncs")
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
