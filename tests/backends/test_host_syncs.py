"""The data plane's cost per tensor, counted deterministically (no timing).

One warm round of 1,000 and of 8,000 small tensors, nccl and ipc (sharded_rdt's
count, per gather group, is in its loopback tests; sparse_nccl has no finite
check and no per-tensor packing): the host
syncs (`wt_tools.counting.HostSyncs`) on the trainer and in each worker process
must not grow with the tensor count (at most 2 per bucket), and the trainer
thread's aten ops stay at most 4 per tensor. On a GPU every host sync stalls
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
from weight_transfer.transport.group import free_port

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
