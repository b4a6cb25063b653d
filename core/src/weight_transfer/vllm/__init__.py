"""The vLLM side of wt: the only part of wt-core that imports vLLM.

- `weight_transfer.vllm.plugin:register` (entry point in vLLM's
  `vllm.general_plugins` group): every installed wt worker engine becomes a
  vLLM weight-transfer backend named `wt_<name>`, imported only when vLLM
  creates it. Select one with `WeightTransferConfig(backend="wt_nccl")` or
  `--weight-transfer-config '{"backend": "wt_nccl"}'`.
  It also registers vLLM as wt-core's host (`host.VLLMHost`,
  `weight_transfer.runtime.hosts`), which gives a worker engine's round its
  loader and generation:
- `weight_transfer.vllm.loader.VLLMLoader`: what `WeightTransferEngine.new_loader()`
  returns inside a vLLM worker (layerwise reload with an exact rollback).
- `weight_transfer.vllm.serving`, `snapshot`, `moe`: generation seen from a
  worker, the rollback snapshot, and fused-expert layouts.

(The demo, the bench and the tiny checkpoint builder are applications:
wt-tools, `wt_tools.demo`, `wt_tools.bench`, `wt_tools.tiny_model`.)

Importing this package imports nothing from vLLM.
"""

from __future__ import annotations

from weight_transfer.position import is_vllm_config

__all__ = ["BACKEND_PREFIX", "is_vllm_config"]

BACKEND_PREFIX = "wt_"
