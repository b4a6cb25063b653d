"""How received tensors reach a model, transactionally.

A worker engine hands batches of `(name, tensor)` in HF names to a
`WeightLoader`, bracketed by `begin()` and `commit()`; on any failure it calls
`abort()`, after which the model must serve what it served before `begin()`.

`DirectLoader` calls `model.load_weights(batch)` and keeps an undo copy of
every parameter a batch overwrites, so `abort()` restores them. Inside vLLM
(`vllm_config` is a `VllmConfig`) `loader_for` returns the bridge's
`weight_transfer.vllm.loader.VLLMLoader`, which wraps layerwise reload; vLLM is
imported only then.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["WeightLoader", "DirectLoader", "loader_for", "register_loader_provider"]


@runtime_checkable
class WeightLoader(Protocol):
    def begin(self) -> None:
        """Open an update; the model keeps serving its current weights until commit."""

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load a batch of full tensors by HF name."""

    def commit(self) -> None:
        """Make everything loaded since `begin()` the model's weights."""

    def abort(self) -> None:
        """Undo everything loaded since `begin()`; idempotent."""


class DirectLoader:
    """`model.load_weights` with an undo copy of the model's parameters.

    The model must expose `load_weights(iterable of (name, tensor))`. `begin()`
    copies every parameter (`named_parameters()`), so `abort()` restores them
    whatever names the model's loader maps (fused or renamed parameters). Cost:
    one copy of the parameters per round.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._undo: dict[str, torch.Tensor] | None = None

    def begin(self) -> None:
        self._undo = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        load_weights = getattr(self.model, "load_weights", None)
        if load_weights is None:
            raise TypeError(f"{type(self.model).__name__} has no load_weights(weights)")
        load_weights(weights)

    def commit(self) -> None:
        self._undo = None

    def abort(self) -> None:
        undo, self._undo = self._undo, None
        if not undo:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, old in undo.items():
                params[name].copy_(old)


LoaderProvider = Callable[[torch.nn.Module, Any], "WeightLoader | None"]
_providers: list[LoaderProvider] = []


def register_loader_provider(provider: LoaderProvider) -> None:
    """Add `provider(model, vllm_config) -> WeightLoader | None`, tried newest first."""
    _providers.insert(0, provider)


def is_vllm_config(vllm_config: Any) -> bool:
    """Whether `vllm_config` is a `vllm.config.VllmConfig` (never imports vllm)."""
    config_module = sys.modules.get("vllm.config")
    vllm_config_cls = getattr(config_module, "VllmConfig", None)
    return vllm_config_cls is not None and isinstance(vllm_config, vllm_config_cls)


def loader_for(model: torch.nn.Module, vllm_config: Any, model_config: Any = None) -> WeightLoader:
    """The loader for `model`: the first provider's answer; inside vLLM the
    layerwise-reload loader (`model_config` is the target's, e.g. the draft
    model's; `None` means `vllm_config.model_config`); else a `DirectLoader`."""
    for provider in _providers:
        loader = provider(model, vllm_config)
        if loader is not None:
            return loader
    if is_vllm_config(vllm_config):
        from weight_transfer.vllm.loader import VLLMLoader

        return VLLMLoader(model, vllm_config, model_config)
    return DirectLoader(model)
