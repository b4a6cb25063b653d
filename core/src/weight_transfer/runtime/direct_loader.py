"""`DirectLoader`: the loader of a model outside any inference host.

`weight_transfer.loading.loader_for` picks it for a plain `nn.Module` (worker
processes, `WorkerSession`, tests): each round keeps an undo copy of the
parameters it changes, so an abort restores them exactly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch

from weight_transfer.runtime.phases import timed
from weight_transfer.runtime.slices import (
    DryRun,
    Scatter,
    parameter_targets,
    write_scatters,
)

__all__ = ["DirectLoader"]


class DirectLoader:
    """Loads into a model outside vLLM, with an undo copy of what a round changes.

    A model with `load_weights(iterable of (name, tensor))` loads through it
    (fused or renamed parameters are its business). A plain `nn.Module` is
    served by copying each tensor into the parameter of the same name, whose
    shape and dtype must match exactly. A module with neither (no
    `load_weights`, no parameters) is refused at `begin`.

    Undo: a plain module's parameter is copied aside just before its first
    overwrite in the round (on the loading thread, so it overlaps the
    transfer); a model with its own `load_weights` may touch any parameter,
    so all are copied aside at `prepare()` (before the first load: `begin()`
    touches nothing, so a round that loads nothing leaves a kept record
    intact). `abort()` copies back what was set aside; so does `revert()`
    after `commit(keep_undo=True)` (a `Revertible`). The undo buffers belong
    to the model and are reused every round (a fresh copy per round costs
    more in page faults than in copying); their cost is one copy of the
    parameters, kept while the model lives.
    Parameters keep their storage: loads and restores are in place.

    `undo=False` keeps no undo copy (a benchmark pricing the transport alone,
    or a model whose copy does not fit): `abort()` then leaves what was loaded,
    and `exact_undo` is False.
    """

    def __init__(self, model: torch.nn.Module, *, undo: bool = True) -> None:
        self.model = model
        self.undo = undo
        self.exact_undo = undo
        self._saved: set[str] | None = None  # names set aside this round
        self._params: dict[str, torch.Tensor] | None = None
        self._prepared = False
        self._kept: set[str] | None = None  # names of a committed round kept for revert()

    def _undo_store(self) -> dict[str, torch.Tensor]:
        return _UNDO.setdefault(self.model, {})

    def _set_aside(self, name: str, param: torch.Tensor) -> None:
        self._set_aside_all([(name, param)])

    def _set_aside_all(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Copy `params` into their undo buffers, in one batched copy."""
        assert self._saved is not None
        if not self.undo or not params:
            return
        store = self._undo_store()
        saved = []
        for name, param in params:
            buffer = store.get(name)
            if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                buffer = store[name] = torch.empty_like(param)
            saved.append(buffer)
            self._saved.add(name)
        torch._foreach_copy_(saved, [p.detach() for _, p in params])

    def begin(self) -> None:
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        own_loader = callable(getattr(self.model, "load_weights", None))
        if not own_loader and not params:
            raise TypeError(
                f"{type(self.model).__name__} has neither load_weights(weights) nor "
                "parameters: DirectLoader cannot load weights into it"
            )
        self._params = params  # the round's parameters by name, walked once
        self._saved = set()
        self._prepared = False

    def prepare(self) -> None:
        """Before the first load of a round: a model with its own `load_weights`
        has every parameter set aside (it may touch any of them)."""
        if self._saved is None:
            raise RuntimeError("DirectLoader.prepare: no open round (begin() first, or aborted)")
        if self._prepared:
            return
        self._prepared = True
        if callable(getattr(self.model, "load_weights", None)) and self.undo:
            with torch.no_grad():
                self._set_aside_all(list(self.model.named_parameters()))

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.prepare()
        load_weights = getattr(self.model, "load_weights", None)
        with timed("load"):
            if callable(load_weights):
                load_weights(weights)
            else:
                self._copy_by_name(weights)

    def _copy_by_name(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the parameter of its name: the checks per tensor, the
        undo record and the copies each one batched copy per call."""
        assert self._saved is not None
        params = self._params if self._params is not None else dict(self.model.named_parameters())
        fresh: list[tuple[str, torch.Tensor]] = []  # parameters first overwritten now
        first: set[str] = set()
        into: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise KeyError(f"{type(self.model).__name__} has no parameter named {name!r}")
            if param.shape != tensor.shape or param.dtype != tensor.dtype:
                raise ValueError(
                    f"{name!r}: received {tensor.dtype} {list(tensor.shape)}, the "
                    f"parameter is {param.dtype} {list(param.shape)}"
                )
            if name not in self._saved and name not in first:
                first.add(name)
                fresh.append((name, param))
            into.append(param)
            values.append(tensor)
        with torch.no_grad():
            self._set_aside_all(fresh)
            torch._foreach_copy_(into, values)

    # -- slices ------------------------------------------------------------
    @contextlib.contextmanager
    def dry_run(self) -> Iterator[DryRun]:
        """The model's own loading code; its parameters are the real ones (a
        recording tensor's copy writes nothing)."""
        load_weights = getattr(self.model, "load_weights", None)
        params = dict(self.model.named_parameters())

        def load(weights: list[tuple[str, torch.Tensor]]) -> None:
            if callable(load_weights):
                load_weights(weights)
                return
            for name, tensor in weights:
                if name in params:
                    params[name].data.copy_(tensor)

        yield load, parameter_targets(self.model.named_modules())

    def begin_module(self, module: str, zero: Iterable[str]) -> None:
        """Nothing: a plain model's parameters are real; uncovered elements keep their values."""

    def write(self, writes: Sequence[tuple[Scatter, torch.Tensor]]) -> None:
        self.prepare()
        assert self._saved is not None
        params = self._params if self._params is not None else dict(self.model.named_parameters())
        fresh: dict[str, torch.Tensor] = {}  # parameters first overwritten now
        placed = []
        for scatter, src in writes:
            name = f"{scatter.module}.{scatter.param}" if scatter.module else scatter.param
            param = params.get(name)
            if param is None:
                raise KeyError(f"{type(self.model).__name__} has no parameter named {name!r}")
            if name not in self._saved:
                fresh[name] = param
            placed.append((param, scatter, src))
        with torch.no_grad():
            self._set_aside_all(list(fresh.items()))
        write_scatters(placed)

    def end_module(self, module: str) -> None:
        """Nothing: a plain model has no post-load processing."""

    def commit(self, keep_undo: bool = False) -> None:
        saved, self._saved, self._params = self._saved, None, None
        self._kept = saved if keep_undo and self.undo else None

    def abort(self) -> None:
        saved, self._saved, self._params = self._saved, None, None
        self._restore(saved)

    def revert(self) -> None:
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError("DirectLoader.revert: no committed round was kept (keep_undo)")
        self._restore(kept)

    def release(self) -> None:
        self._kept = None

    def _restore(self, names: set[str] | None) -> None:
        if not names:
            return
        params = dict(self.model.named_parameters())
        store = self._undo_store()
        with torch.no_grad():
            torch._foreach_copy_([params[n] for n in names], [store[n] for n in names])


# Undo buffers per model (see `DirectLoader`); they go with the model.
_UNDO: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
