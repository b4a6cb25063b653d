"""The CUDA IPC plane of wt-ipc: a trainer (this process) and a worker process on one GPU.

Skipped without CUDA. The staging buffers are device memory exported once per
reader as JSON records (base64 handle bytes, device UUID, offsets); the
worker opens them on its own index for that UUID and loads from views.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.harness import RecordingClient, WorkerPool, digest
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_tensors(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in mixed_tensors(seed, big_numel=300_000).items()}


@pytest.mark.parametrize("packed", [True, False])
def test_cuda_ipc_between_two_processes_on_one_gpu_bit_exact(packed: bool) -> None:
    from wt_ipc import IPCTrainerInitInfo

    tensors = cuda_tensors(1)
    with WorkerPool("ipc", 1, names=list(tensors), devices=["cuda:0"]) as pool:
        client = RecordingClient(pool.client())
        info = IPCTrainerInitInfo(
            rank=0, device="cuda:0", packed=packed, packed_buffer_size_bytes=256 << 10,
            timeout_s=60,
        )  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=DictSource(tensors)
        )
        payload = client.payloads[0]
        assert payload["plane"] == "cuda"
        assert json.loads(json.dumps(payload)) == payload
        record = payload["cuda_buffers"][0][0]
        assert record["device_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
        for seed in (2, 3, 4):
            for name, t in cuda_tensors(seed).items():
                tensors[name].copy_(t)
            engine.send_weights()
            (got,) = pool.each("digests")
            assert got == {n: digest(t.cpu()) for n, t in tensors.items()}
        engine.shutdown()


def test_a_gpu_the_worker_cannot_see_is_refused_listing_the_visible_ones() -> None:
    from wt_ipc import IPCTrainerInitInfo

    tensors = cuda_tensors(5)

    class _OtherGPU(RecordingClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            buffers = [[{**r, "device_uuid": "GPU-not-here"} for r in rs]
                       for rs in init_info["cuda_buffers"]]  # fmt: skip
            self.inner.init_weight_transfer_engine({**init_info, "cuda_buffers": buffers})

    with WorkerPool("ipc", 1, names=list(tensors), devices=["cuda:0"]) as pool:
        info = IPCTrainerInitInfo(rank=0, device="cuda:0", timeout_s=60)
        with pytest.raises(WeightSyncRPCError, match=r"GPU-not-here is not visible.*visible: "):
            WeightTransferTrainerFactory.trainer_init(
                info, client=_OtherGPU(pool.client()), source=DictSource(tensors)
            )


class _Records(RecordingClient):
    """Rewrites worker 0's list of exported records in the handshake."""

    def __init__(self, inner: Any, rewrite: Any) -> None:
        super().__init__(inner)
        self.rewrite = rewrite

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        buffers = [self.rewrite(init_info["cuda_buffers"][0]), *init_info["cuda_buffers"][1:]]
        self.inner.init_weight_transfer_engine({**init_info, "cuda_buffers": buffers})


CUDA_REWRITES = {
    "repeated": (
        lambda records: [records[0]] * len(records),
        r"'cuda_buffers\[0\]\[1\]' repeats 'cuda_buffers\[0\]\[0\]'",
    ),
    "swapped": (
        lambda records: records[::-1],
        r"'cuda_buffers\[0\]\[0\]': the buffer is staging buffer 1, not 0",
    ),
}


@pytest.mark.parametrize("case", list(CUDA_REWRITES))
def test_repeated_or_reordered_cuda_records_are_refused_naming_the_record(case: str) -> None:
    from wt_ipc import IPCTrainerInitInfo

    rewrite, match = CUDA_REWRITES[case]
    tensors = cuda_tensors(6)
    info = IPCTrainerInitInfo(rank=0, device="cuda:0", timeout_s=60)
    with WorkerPool("ipc", 1, names=list(tensors), devices=["cuda:0"]) as pool:
        with pytest.raises(WeightSyncRPCError, match=match):
            WeightTransferTrainerFactory.trainer_init(
                info, client=_Records(pool.client(), rewrite), source=DictSource(tensors)
            )
        assert pool.each("digests") == [{}]  # nothing loaded
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=pool.client(), source=DictSource(tensors)
        )
        engine.send_weights()  # the worker is as good as new
        assert pool.each("digests") == [{n: digest(t.cpu()) for n, t in tensors.items()}]
        engine.shutdown()


def test_a_worker_whose_link_closed_is_attached_again_with_fresh_exports() -> None:
    from wt_ipc import IPCTrainerInitInfo

    tensors = cuda_tensors(7)
    with WorkerPool("ipc", 1, names=list(tensors), devices=["cuda:0"]) as pool:
        client = RecordingClient(pool.client())
        engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, device="cuda:0", timeout_s=60),
            client=client,
            source=DictSource(tensors),
        )
        engine.send_weights()
        pool.on(0, "shutdown_weight_transfer_engine")  # the worker lets go of its opens
        for name, t in cuda_tensors(8).items():
            tensors[name].copy_(t)
        engine.send_weights()  # attaches again: new buffers, exported once more
        handshakes = [p for p in client.payloads if "cuda_buffers" in p]
        assert len(handshakes) == 2
        assert pool.each("digests") == [{n: digest(t.cpu()) for n, t in tensors.items()}]
        engine.shutdown()


def test_live_vllm_on_the_gpu_over_cuda_ipc(tmp_path: Any) -> None:
    pytest.importorskip("vllm")
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from wt_tools.tiny_model import build_tiny_llama, tiny_llama

    from weight_transfer import LocalVLLMWeightSyncClient, ModuleSource
    from wt_ipc import IPCTrainerInitInfo

    served = build_tiny_llama(str(tmp_path / "seed1"), seed=1)
    target_dir = build_tiny_llama(str(tmp_path / "seed2"), seed=2)
    common: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                              "gpu_memory_utilization": 0.2}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = ["w1 w2 w3", "w7"]

    def outputs(llm: Any) -> list[Any]:
        result = []
        for out in llm.generate(prompts, params):
            completion = out.outputs[0]
            logprobs = [sorted((t, lp.logprob) for t, lp in p.items()) for p in completion.logprobs]
            result.append((list(completion.token_ids), logprobs))
        return result

    reference = outputs(LLM(model=target_dir, **common))
    llm = LLM(model=served, weight_transfer_config=WeightTransferConfig(backend="wt_ipc"), **common)
    model = tiny_llama(seed=2).cuda()
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, device="cuda:0", timeout_s=120),
        client=LocalVLLMWeightSyncClient(llm),
        source=ModuleSource(model),
    )
    engine.send_weights()
    assert outputs(llm) == reference
    engine.shutdown()
