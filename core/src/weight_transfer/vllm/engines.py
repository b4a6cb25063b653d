"""Lazy access to wt worker engines under their vLLM names.

`weight_transfer.vllm.engines.wt_<name>` is the worker engine class of the wt
backend `<name>`, resolved through `WeightTransferEngineFactory` (so an unknown,
ambiguous or broken backend fails with wt's message naming the distribution)
on first attribute access, which vLLM makes when it creates the engine. Once
resolved, backends with a vLLM-specific seam are connected to the bridge
(`wt_sparse_nccl`: `weight_transfer.vllm.sparse`).
"""

from __future__ import annotations

import sys
from typing import Any

from weight_transfer.vllm import BACKEND_PREFIX


def _connect_seams() -> None:
    if "wt_sparse_nccl.worker" in sys.modules:
        from weight_transfer.vllm.sparse import install_if_loaded

        install_if_loaded()


def __getattr__(attr: str) -> Any:
    if not attr.startswith(BACKEND_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    from weight_transfer.factory import WeightTransferEngineFactory

    engine_cls = WeightTransferEngineFactory.get_engine_class(attr[len(BACKEND_PREFIX) :])
    _connect_seams()
    return engine_cls
