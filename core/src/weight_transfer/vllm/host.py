"""vLLM as wt-core's host (`weight_transfer.runtime.hosts`), registered by the plugin."""

from __future__ import annotations

from typing import Any

import torch

from weight_transfer.vllm import is_vllm_config

__all__ = ["VLLMHost"]


class VLLMHost:
    """Owns every `VllmConfig`: its loader is `VLLMLoader` (layerwise reload), its
    generation the engine core running the calling worker (`serving.Generation`), its
    adapter loader `adapters.AdapterLoader` (LoRA adapters kept in memory)."""

    def owns(self, vllm_config: Any) -> bool:
        return is_vllm_config(vllm_config)

    def loader(self, model: torch.nn.Module, vllm_config: Any, model_config: Any) -> Any:
        from weight_transfer.vllm.loader import VLLMLoader

        return VLLMLoader(model, vllm_config, model_config)

    def adapter_loader(self, model: torch.nn.Module, vllm_config: Any, adapter: Any) -> Any:
        """The loader of a LoRA adapter round (`weight_transfer.vllm.adapters`)."""
        from weight_transfer.vllm.adapters import AdapterLoader

        return AdapterLoader(model, vllm_config, adapter)

    def unsupported(self, vllm_config: Any) -> str | None:
        """EPLB moves experts between physical slots at run time; a checkpoint-format
        update does not follow those moves (it can land on the wrong logical experts,
        silently), so an engine with EPLB takes no update."""
        parallel = getattr(vllm_config, "parallel_config", None)
        if getattr(parallel, "enable_eplb", False):
            return (
                "this engine runs expert-parallel load balancing (EPLB, enable_eplb=True): "
                "its physical expert slots move at run time and wt does not map updates "
                "onto them; start the engine without --enable-eplb to sync weights through wt"
            )
        return None

    def generation(self) -> Any:
        from weight_transfer.vllm.serving import Generation

        return Generation.of_caller()
