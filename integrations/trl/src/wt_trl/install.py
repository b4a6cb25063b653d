"""`install()`: TRL's trainers build wt-trl's client where they build their own."""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

from wt_trl.settings import settings

__all__ = ["install", "SUPPORTED_TRL", "TRL_CLIENT_HOMES"]

SUPPORTED_TRL = ("1.16.0",)
# The modules whose `VLLMClient` name TRL's trainers build their client from: the
# trainers on `VLLMGeneration` (GRPO, RLOO, distillation, ...) and OnlineDPO.
TRL_CLIENT_HOMES = (
    "trl.generation.vllm_generation",
    "trl.experimental.online_dpo.online_dpo_trainer",
)
_WEIGHT_METHODS = (
    "init_communicator",
    "update_named_param",
    "update_named_params",
    "update_model_params",
    "weight_update",
    "reset_prefix_cache",
    "close_communicator",
)


def install(*, replace_trainer: bool | None = None, timeout_s: float | None = None) -> None:
    """Make TRL's trainers sync weights through wt: every module TRL builds its vLLM
    client from (`TRL_CLIENT_HOMES`) builds `WTVLLMClient` instead. Call it once,
    before building the trainer; the server runs a wt backend (`wt_nccl`).

    `replace_trainer` (default: the environment's `WT_TRL_REPLACE_TRAINER=1`)
    lets a restarted trainer take the server over from one still alive;
    `timeout_s` bounds every wait of a sync (300 s). Refuses, changing nothing,
    a TRL other than `SUPPORTED_TRL` or one whose client is not where wt-trl
    puts its own (`RuntimeError` naming the supported versions)."""
    import trl
    from trl.generation import vllm_client

    from wt_trl.client import WTVLLMClient

    version = getattr(trl, "__version__", "unknown")
    supported = ", ".join(SUPPORTED_TRL)
    if version not in SUPPORTED_TRL:
        raise RuntimeError(
            f"wt-trl supports TRL {supported}; this is TRL {version}, whose trainers may build "
            f"their vLLM client elsewhere: install trl=={SUPPORTED_TRL[-1]}"
        )
    homes = [_home(name) for name in TRL_CLIENT_HOMES]
    for name, module in zip(TRL_CLIENT_HOMES, homes, strict=True):
        client = getattr(module, "VLLMClient", None)
        missing = [m for m in _WEIGHT_METHODS if not callable(getattr(client, m, None))]
        if client not in (vllm_client.VLLMClient, WTVLLMClient) or missing:
            raise RuntimeError(
                f"TRL {version}'s {name}.VLLMClient is not the client wt-trl replaces "
                f"(missing {missing or 'nothing'}); wt-trl supports TRL {supported}"
            )
    if replace_trainer is None:
        replace_trainer = os.environ.get("WT_TRL_REPLACE_TRAINER", "") == "1"
    settings.replace_trainer = replace_trainer
    if timeout_s is not None:
        settings.timeout_s = float(timeout_s)
    for module in homes:
        module.VLLMClient = WTVLLMClient


def _home(name: str) -> Any:
    with warnings.catch_warnings():  # OnlineDPO's home warns that it is experimental
        warnings.simplefilter("ignore")
        return importlib.import_module(name)
