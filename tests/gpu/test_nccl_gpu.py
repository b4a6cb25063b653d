"""The CUDA paths of wt-nccl: packing on one GPU, and NCCL broadcast between two GPUs.

Skipped without CUDA. On a machine with GPUs these run as part of the suite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import WorkerPool, digest
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightTransferTrainerFactory
from wt_kits.group.stateless import free_port
from wt_kits.stream.packing import RotatingBuffers, Unpacker, as_bytes, plan_buckets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_tensors(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in mixed_tensors(seed, big_numel=300_000).items()}


def test_packing_round_trip_on_one_gpu() -> None:
    tensors = cuda_tensors(0)
    metas = DictSource(tensors).metadata()
    plan = plan_buckets(metas, buffer_bytes=256 << 10, min_bucket_bytes=0)
    buffers = RotatingBuffers(2, "cuda")
    unpacker = Unpacker(plan, "cuda")
    out: dict[str, torch.Tensor] = {}
    sources = [as_bytes(t) for t in tensors.values()]
    for k, bucket in enumerate(plan.buckets):
        buf = buffers.get(k, bucket.nbytes)
        for piece in bucket.pieces:
            src = sources[piece.param][piece.start : piece.start + piece.nbytes]
            buf[piece.offset : piece.offset + piece.nbytes].copy_(src)
        for name, t in unpacker.unpack(k, buf, view_horizon=0):
            assert t.is_cuda
            out[name] = t.clone()
    torch.cuda.synchronize()
    assert {n: digest(t.cpu()) for n, t in out.items()} == {
        n: digest(t.cpu()) for n, t in tensors.items()
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("packed", [True, False])
def test_nccl_broadcast_between_two_gpus(packed: bool) -> None:
    from wt_nccl import NCCLTrainerInitInfo

    tensors = cuda_tensors(1)
    with WorkerPool("nccl", 1, names=list(tensors), devices=["cuda:1"]) as pool:
        info: Any = NCCLTrainerInitInfo(
            "127.0.0.1", free_port(), 2, rank=0, device="cuda:0", packed=packed, timeout_s=60
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=pool.client(), source=DictSource(tensors)
        )
        for seed in (2, 3):
            for name, t in cuda_tensors(seed).items():
                tensors[name].copy_(t)
            engine.send_weights()
            (got,) = pool.each("digests")
            assert got == {n: digest(t.cpu()) for n, t in tensors.items()}
        engine.shutdown()


def test_cpu_trainer_feeds_a_gpu_worker_over_gloo() -> None:
    """One GPU: the engine holds it, so the trainer streams from CPU over gloo."""
    from wt_nccl import NCCLTrainerInitInfo

    tensors = mixed_tensors(4, big_numel=100_000)
    with WorkerPool("nccl", 1, names=list(tensors), devices=["cuda:0"]) as pool:
        info: Any = NCCLTrainerInitInfo(
            "127.0.0.1", free_port(), 2, rank=0, device="cpu", timeout_s=60
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=pool.client(), source=DictSource(tensors)
        )
        engine.send_weights()
        (got,) = pool.each("digests")
        assert got == {n: digest(t) for n, t in tensors.items()}
        engine.shutdown()
