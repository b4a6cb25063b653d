"""How received tensors reach a model, transactionally.

A `Transaction` is what a worker engine's round holds open: `begin()` at
`start_weight_update`, `commit()` at `finish_weight_update`, `abort()` on any
failure, after which the model serves exactly what it served before `begin()`.
The engine base class (`weight_transfer.base.WeightTransferEngine`) drives it;
a backend never calls these three itself.

A `WeightLoader` is a transaction that also takes batches of `(name, tensor)`
in HF names (`load`). `loader_for` picks one per round:

1. a provider registered with `register_loader_provider`, newest first;
2. inside an inference host, the host's loader (`weight_transfer.runtime.hosts`:
   in vLLM, `weight_transfer.vllm.loader.VLLMLoader`, a layerwise reload);
3. `weight_transfer.runtime.direct_loader.DirectLoader` for any other `nn.Module`.

Both built-in loaders are also `SliceLoader`s: they can run the model's
loading code as a dry run over recording tensors (`dry_run`, see
`weight_transfer.runtime.slices`) and take recorded slices directly (`begin_module`,
`write`, `end_module`), which is how slice-exact backends load without
calling `load_weights` every round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch

from weight_transfer.runtime.direct_loader import DirectLoader
from weight_transfer.runtime.hosts import host_of
from weight_transfer.runtime.slices import DryRun, Scatter

__all__ = [
    "Transaction",
    "Revertible",
    "WeightLoader",
    "SliceLoader",
    "DryRun",
    "loader_for",
    "register_loader_provider",
]


@runtime_checkable
class Transaction(Protocol):
    """One round's changes to a model: all of them, or none."""

    def begin(self) -> None:
        """Open the round; raise (changing nothing) if the model cannot take one.

        A transaction may also define `prepare()`, which the engine calls before
        each update: one that must change the model to receive (vLLM's
        layerwise reload) defers that to its first `prepare()`, so a round that
        never reaches an update leaves the model as it was.
        """

    def commit(self) -> None:
        """Make the round's changes the model's weights. One that raises has rolled back."""

    def abort(self) -> None:
        """Undo every change since `begin()`; idempotent, and a no-op after `commit()`.

        A transaction may define `exact_undo = False`: it keeps no undo record, and
        its abort leaves what was loaded (see `WeightTransferEngine.incomplete`).
        """


@runtime_checkable
class Revertible(Transaction, Protocol):
    """A transaction whose commit can be undone until another round loads.

    `commit(keep_undo=True)` commits but keeps the undo record; then exactly
    one of `revert()` (the model serves what it served before `begin()`
    again) or `release()` (the record is dropped) ends it. The record lives
    in buffers the next round reuses, so the engine releases it before a new
    round loads anything. This is what lets a fleet take back a replica that
    committed while another failed (`weight_transfer.fleet`).
    """

    def commit(self, keep_undo: bool = False) -> None: ...

    def revert(self) -> None:
        """Undo the committed round whose record was kept; `RuntimeError` if none is."""

    def release(self) -> None:
        """Drop a kept undo record; idempotent."""


@runtime_checkable
class WeightLoader(Transaction, Protocol):
    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load a batch of full tensors by HF name."""


@runtime_checkable
class SliceLoader(WeightLoader, Protocol):
    """A loader that also takes recorded slices (`weight_transfer.runtime.slices`).

    `dry_run()` (outside a round) yields the model's load function and its
    checkpoint-format parameters by storage; whatever it changes to run the
    model's loading code is undone when the context exits, so the model is
    servable again. Inside a round: `begin_module(module, zero)` before the
    first write into a module (`zero`: its parameters the slices do not
    cover entirely, which start at zero), `write(writes)` with `(scatter, src)`
    pairs of begun modules (a pull's slices at once: one batched copy),
    `end_module(module)` after the last (the module's post-load processing
    runs there). Writes are undone by `abort()` like any load.
    """

    def dry_run(self) -> contextlib.AbstractContextManager[DryRun]: ...

    def begin_module(self, module: str, zero: Iterable[str]) -> None: ...

    def write(self, writes: Sequence[tuple[Scatter, torch.Tensor]]) -> None: ...

    def end_module(self, module: str) -> None: ...


LoaderProvider = Callable[[torch.nn.Module, Any], "WeightLoader | None"]
_providers: list[LoaderProvider] = []


def register_loader_provider(provider: LoaderProvider) -> None:
    """Add `provider(model, vllm_config) -> WeightLoader | None`, tried newest first."""
    _providers.insert(0, provider)


def loader_for(model: torch.nn.Module, vllm_config: Any, model_config: Any = None) -> WeightLoader:
    """The loader for `model` (see the module docstring for the order).

    `model_config` is the target's (the draft model's for a draft update);
    `None` means `vllm_config.model_config`.
    """
    for provider in _providers:
        loader = provider(model, vllm_config)
        if loader is not None:
            return loader
    host = host_of(vllm_config)
    if host is not None:
        return cast(WeightLoader, host.loader(model, vllm_config, model_config))
    return DirectLoader(model)
