"""A LoRA adapter's sync against vLLM's own way in: save it, then load it from disk.

`measure(label, spec, repeats, work)` runs one in-process vLLM `LLM` with
`enable_lora=True` on `wt_nccl` for a tiny Llama `spec`, and a PEFT model of
the same base with a rank-16 adapter on every projection. Each repeat changes the adapter (an
optimizer step's worth), then times side by side, in the same engine:

- **wt**: `send_weights()` (only the adapter's tensors travel; the new
  version is swapped in at finish), then the first request on the adapter
  (which activates the new version into a LoRA slot);
- **disk**: PEFT's `save_pretrained`, vLLM's `add_lora` with `load_inplace`
  (what the server's `/v1/load_lora_adapter` runs), then the first request.

Both requests are one token; the two adapters' greedy outputs are compared
(they must be equal). Bytes are what left wt's sender (the `wt_chunk_moved`
hook) and the size of the saved files.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

__all__ = ["measure", "table", "TARGETS"]

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(label: str, spec: Any, repeats: int, work: str) -> dict[str, Any]:
    """One model spec's row; run it in a fresh process (vLLM pins the process's threads)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from peft import LoraConfig, get_peft_model
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.lora.request import LoRARequest

    from weight_transfer import LocalVLLMWeightSyncClient, LoRASource, WeightTransferTrainerFactory
    from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks
    from weight_transfer.vllm.adapters import lora_request
    from wt_kits.group import free_port
    from wt_nccl import NCCLTrainerInitInfo
    from wt_tools.tiny_model import ENGINE_KWARGS, build_tiny_llama, tiny_llama

    base = build_tiny_llama(os.path.join(work, f"lora-{label}"), seed=1, spec=spec)
    llm = LLM(
        model=base,
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=2,
        weight_transfer_config=WeightTransferConfig(backend="wt_nccl"),
        **ENGINE_KWARGS,
    )
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False
    )
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(seed=1, spec=spec), config)
    source = LoRASource(model, name="bench")

    class Moved:
        total = 0

        @hookimpl
        def wt_chunk_moved(self, nbytes: int) -> None:
            Moved.total += nbytes

    moved = Moved()
    register_hooks(moved)
    info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, device="cpu", timeout_s=120.0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=LocalVLLMWeightSyncClient(llm), source=source
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    check = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def first_token(request: Any) -> float:
        start = time.perf_counter()
        llm.generate(["w1 w2 w3"], one, lora_request=request, use_tqdm=False)
        return time.perf_counter() - start

    wt_s, wt_first, disk_s, disk_first, same = [], [], [], [], []
    disk_bytes = 0
    try:
        trainer.send_weights()  # the adapter's first sync and the first disk load are warm-up
        for step in range(repeats + 1):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".lora_" in name:
                        param.add_(torch.randn_like(param) * 0.01)
            Moved.total = 0
            start = time.perf_counter()
            trainer.send_weights()
            synced = time.perf_counter() - start
            moved_bytes = Moved.total
            synced_first = first_token(lora_request("bench"))
            directory = os.path.join(work, f"lora-{label}-ckpt{step}")
            start = time.perf_counter()
            model.save_pretrained(directory)
            request = LoRARequest("disk", 1, directory, load_inplace=True)
            llm.llm_engine.add_lora(request)
            loaded = time.perf_counter() - start
            loaded_first = first_token(LoRARequest("disk", 1, directory))
            disk_bytes = sum(
                os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
            )
            same.append(
                tokens(llm, check, lora_request("bench"))
                == tokens(llm, check, LoRARequest("disk", 1, directory))
            )
            if step == 0:
                continue  # warm-up
            wt_s.append(synced)
            wt_first.append(synced_first)
            disk_s.append(loaded)
            disk_first.append(loaded_first)
    finally:
        plugin_manager().unregister(moved)
        trainer.shutdown()
    model_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" not in n
    )
    return {
        "label": label,
        "hidden": spec.hidden_size,
        "layers": spec.num_hidden_layers,
        "adapter_bytes": source.nbytes,
        "moved_bytes": moved_bytes,
        "model_bytes": model_bytes,
        "disk_bytes": disk_bytes,
        "wt_sync_s": statistics.median(wt_s),
        "wt_first_request_s": statistics.median(wt_first),
        "disk_load_s": statistics.median(disk_s),
        "disk_first_request_s": statistics.median(disk_first),
        "same_tokens": all(same),
        "repeats": repeats,
    }


def tokens(llm: Any, params: Any, request: Any) -> list[int]:
    out = llm.generate(["w1 w2 w3"], params, lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def table(result: dict[str, Any]) -> list[str]:
    """Rows of `measure` (`{"rank": ..., "rows": [...]}`) as Markdown table lines."""
    rows = [
        f"| model | rank-{result['rank']} adapter MB (model MB) | wt sync s | then 1st token s "
        "| save + load_lora_adapter s | then 1st token s | disk / wt: sync | with 1st token "
        "| MB moved by wt | same tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        wt_total = r["wt_sync_s"] + r["wt_first_request_s"]
        disk_total = r["disk_load_s"] + r["disk_first_request_s"]
        rows.append(
            f"| {r['label']} ({r['layers']} layers, hidden {r['hidden']}) "
            f"| {r['adapter_bytes'] / 1e6:.3f} ({r['model_bytes'] / 1e6:.1f}) "
            f"| {r['wt_sync_s']:.4f} | {r['wt_first_request_s']:.4f} "
            f"| {r['disk_load_s']:.4f} | {r['disk_first_request_s']:.4f} "
            f"| {r['disk_load_s'] / max(r['wt_sync_s'], 1e-9):.1f}x "
            f"| {disk_total / max(wt_total, 1e-9):.1f}x "
            f"| {r['moved_bytes'] / 1e6:.3f} | {r['same_tokens']} |"
        )
    return rows
