"""Lazy access to wt worker engines under their vLLM names.

`weight_transfer.vllm.engines.wt_<name>` is the worker engine class of the wt
backend `<name>`, resolved through `WeightTransferEngineFactory` (so an unknown,
ambiguous or broken backend fails with wt's message naming the distribution)
on first attribute access, which vLLM makes when it creates the engine.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.vllm import BACKEND_PREFIX


def __getattr__(attr: str) -> Any:
    if not attr.startswith(BACKEND_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    from weight_transfer.factory import WeightTransferEngineFactory

    return WeightTransferEngineFactory.get_engine_class(attr[len(BACKEND_PREFIX) :])
