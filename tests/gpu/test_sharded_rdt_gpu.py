"""`sharded_rdt` with CUDA models and CUDA trainer tensors. Skipped without CUDA.

Two tensor-parallel consumers on the GPU pull their slices of a CUDA trainer
source: over the loopback transport (producer and consumers in this
process), and over NIXL with the producer a Ray actor and the receive slots
in device memory (Ray Direct Transport lands the bytes in VRAM), each with
and without verified bytes (the consumer digests the blob on the GPU). Every
parameter equals a fresh shard loaded from the same tensors, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.conftest import ReplicaClient
from tests.backends.sharded_rdt.models import ShardedModel, checkpoint, reference
from tests.backends.sharded_rdt.test_sharded_loopback import HeldSource
from weight_transfer import WorkerPosition, WorkerSession

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in checkpoint(seed).items()}


def run_syncs(transport: str, prefix: str, verify: bool) -> None:
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo
    from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

    tp = 2
    models = [ShardedModel(r, tp).cuda() for r in range(tp)]
    engines = [
        ShardedRDTWorkerEngine(None, WorkerPosition(r, tp), "cuda", m) for r, m in enumerate(models)
    ]
    client = ReplicaClient([WorkerSession(e) for e in engines])
    source = HeldSource(cuda_checkpoint(1))
    info = ShardedRDTTrainerInitInfo(
        rank=0,
        num_consumers=tp,
        transport=transport,
        producer_prefix=prefix,
        timeout_s=60.0,
        verify=verify,
    )
    trainer = ShardedRDTTrainerEngine.trainer_init(info, client=client, source=source)
    try:
        for seed in (2, 3):
            source.tensors = cuda_checkpoint(seed)
            trainer.send_weights()
            for r, model in enumerate(models):
                want = reference(seed, r, tp)
                for name, got in model.state_dict().items():
                    assert got.is_cuda
                    assert torch.equal(got.cpu(), want[name]), f"consumer {r}: {name}"
                assert engines[r].slots[0].is_cuda
    finally:
        trainer.shutdown()
        for e in engines:
            e.shutdown()


@pytest.mark.parametrize("verify", [False, True])
def test_cuda_consumers_over_loopback(verify: bool) -> None:
    run_syncs("loopback", f"wt-gpu-loopback-{verify}", verify)


@pytest.mark.parametrize("verify", [False, True])
def test_cuda_consumers_over_nixl(tmp_path: Any, verify: bool) -> None:
    pytest.importorskip("nixl")
    from tests.backends.sharded_rdt.ray_parts import ray_cluster

    with ray_cluster():
        run_syncs("nixl", f"wt-gpu-nixl-{verify}", verify)
