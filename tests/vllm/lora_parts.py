"""PEFT adapters on the tiny Llama for the LoRA tests, and what they compare with.

`peft_model(*names)`: a fresh tiny Llama (seed 1, what served engines start
from) with one LoRA adapter per name, rank `RANK` on every projection, random
(not zero) `lora_B`, so each adapter changes the output. `train_step` stands in
for an optimizer step. `Checkpoints.save` writes an adapter as PEFT saves it,
and `disk_request` is vLLM's own request for that directory: the reference
every synced adapter is compared with, on the same engine.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from wt_tools.lora_bench import RANK, TARGETS

from tests.vllm.conftest import INITIAL_SEED

ENGINE_LORA_KWARGS: dict[str, Any] = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}


def peft_model(*names: str, seed: int = 0) -> Any:
    from peft import LoraConfig, get_peft_model
    from wt_tools.tiny_model import tiny_llama

    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = get_peft_model(tiny_llama(seed=INITIAL_SEED), config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    return model


def train_step(model: Any, adapter_name: str, step: int) -> None:
    """A deterministic change to every LoRA tensor of `adapter_name`."""
    generator = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f".{adapter_name}." in name and ".lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def lora_bytes(model: Any, adapter_name: str) -> int:
    return sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if f".{adapter_name}." in n and ".lora_" in n
    )


_checkpoint_ids = itertools.count(1)  # one count per process: engines and servers are shared


class Checkpoints:
    """Adapters saved as PEFT saves them, each under a name and id no other has."""

    def __init__(self, root: str) -> None:
        self.root = root

    def save(self, model: Any, adapter_name: str) -> tuple[str, str, int]:
        """(directory, a name for it, an id for it) of `adapter_name` as it is now."""
        k = next(_checkpoint_ids)
        directory = os.path.join(self.root, f"ckpt{k}")
        model.save_pretrained(directory, selected_adapters=[adapter_name])
        if adapter_name != "default":  # PEFT saves other adapters in a folder of their own
            directory = os.path.join(directory, adapter_name)
        return directory, f"disk-{k}", k

    def disk_request(self, model: Any, adapter_name: str) -> Any:
        """vLLM's `LoRARequest` of `adapter_name` saved now (loaded from disk by vLLM)."""
        from vllm.lora.request import LoRARequest

        directory, name, k = self.save(model, adapter_name)
        return LoRARequest(name, k, directory)
