"""Lazy access to wt worker engines under their vLLM names.

`weight_transfer.vllm.engines.wt_<name>` is the class vLLM instantiates for
the wt backend `<name>`: its worker engine inside wt-core's round
(`WeightTransferEngineFactory.hosted_engine_class`). It is resolved on first
attribute access, which vLLM makes when it creates the engine, so an unknown,
ambiguous or broken backend fails with wt's message naming the distribution.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.vllm import BACKEND_PREFIX


def __getattr__(attr: str) -> Any:
    if not attr.startswith(BACKEND_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    from weight_transfer.factory import WeightTransferEngineFactory

    return WeightTransferEngineFactory.hosted_engine_class(attr[len(BACKEND_PREFIX) :])
