"""The vLLM side of wt: the only part of wt-core that imports vLLM.

- `weight_transfer.vllm.plugin:register` (entry point in vLLM's
  `vllm.general_plugins` group): every installed wt worker engine becomes a
  vLLM weight-transfer backend named `wt_<name>`, imported only when vLLM
  creates it. Select one with `WeightTransferConfig(backend="wt_nccl")` or
  `--weight-transfer-config '{"backend": "wt_nccl"}'`.
- `weight_transfer.vllm.loader.VLLMLoader`: what `WeightTransferEngine.new_loader()`
  returns inside a vLLM worker (layerwise reload with an exact rollback).
- `weight_transfer.vllm.tiny_model`: a small random Llama checkpoint, built locally.
- `python -m weight_transfer.vllm.demo` (`wt demo`): train, sync, verify.

Importing this package imports nothing from vLLM.
"""

from __future__ import annotations

__all__ = ["BACKEND_PREFIX"]

BACKEND_PREFIX = "wt_"
