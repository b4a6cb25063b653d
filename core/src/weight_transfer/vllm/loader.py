"""`VLLMLoader`: the `WeightLoader` for a model inside a vLLM worker.

- `begin()`: opens the round; the model is untouched.
- `prepare()` (the engine calls it before each update; `load` calls it too):
  once per round, `ModelSnapshot.take(model)`, then
  `initialize_layerwise_reload(model)`.
- `load(batch)`: `model.load_weights(batch)` (HF names, checkpoint format) with
  the vLLM config current, the MTP completeness check off (a round arrives in
  several batches) and, on CUDA, the model's device current, so it also works
  from a transport's background thread. When it returns, the model holds no
  view into a batch tensor's buffer: layerwise reload keeps a layer's tensors
  until the layer is complete, and some layers (vocabulary-padded embeddings
  and heads) complete only at finalize, so views held by layers still pending
  are replaced by copies. A transport may therefore reuse its receive buffers
  as soon as `load` returns. (A tensor that owns its whole storage is taken
  over as is: the transport must not reuse it.)
- `commit()`: `finalize_layerwise_reload(model, model_config)`; if that raises,
  the round is aborted before the error propagates. Fused-MoE layers whose
  kernel prepacks its weights (vLLM's CPU experts), which that reload would
  corrupt, are reloaded apart (`weight_transfer.vllm.moe`): taken out at
  `prepare()`, post-processed once and installed at `commit()`.
- `abort()`: restores the snapshot; the model serves exactly the weights it
  served before `begin()`.
- `commit(keep_undo=True)` (a `Revertible`): the snapshot outlives the commit
  until `revert()` restores it or `release()` drops it; until then it holds
  what it references (on CPU the previous packed Linear weights).

The snapshot copies the tensors a reload overwrites in place (see
`weight_transfer.vllm.snapshot`): on CPU only embeddings, norms and lm_head (a
few MB), on CUDA the whole model, to pinned host memory by default. The
environment variable `WT_VLLM_SNAPSHOT` (read by the worker) chooses where:
`host` (default), `device`, or `none`: no copy, for a model whose copy does not
fit. A failed round then keeps the new weights in the layers that completed
before the failure, so the loader says `exact_undo = False` and the engine keeps
generation paused until a complete round lands (`WeightTransferEngine.incomplete`).

Slices (`weight_transfer.loading.SliceLoader`): `dry_run()` opens a round of
its own, runs the model's loaders unwrapped (their original functions, not
the reload's deferring wrappers) over checkpoint-format meta parameters and
aborts the round, so the model is restored exactly; in a round,
`begin_module` materializes a layer, `write` copies a slice into it and
`end_module` runs the layer's post-load processing (vLLM's layerwise step:
quantization or CPU repacking, then the copy into the kernel tensors).

`commit()` and `abort()` after the round has ended are no-ops, so a worker
that calls finish again after a failed finish clears its state. Calls are
serialized: an `abort()` from the control thread waits for a `load()` running
on a transport thread, and a `load()` after the round ended raises.

Between `prepare()` and the end of the round the model's layers live on the
meta device: generation must be paused, as for any vLLM weight update (the
clients do). A round that ends before its first update never touched the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import torch

from weight_transfer.runtime.phases import timed
from weight_transfer.runtime.slices import DryRun, Scatter, parameter_targets, write_scatters
from weight_transfer.vllm.moe import PrepackedExperts, prepacked_expert_layers
from weight_transfer.vllm.snapshot import COPY_MODES, ModelSnapshot

__all__ = [
    "VLLMLoader",
    "WeightLoadError",
    "SNAPSHOT_ENV",
    "RELOAD_LOGGER",
    "quiet_reload_warnings",
]

SNAPSHOT_ENV = "WT_VLLM_SNAPSHOT"

logger = logging.getLogger("weight_transfer.vllm")


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def quiet_reload_warnings(layer_classes: Collection[str] | None = None) -> Iterator[None]:
    """Drop layerwise reload's "Failed to load weights" warning, for `layer_classes`
    only (all layers when `None`: a reload of some layers on purpose).

    The reload warns for every layer it loaded nothing into, which after a
    complete sync means the layers whose tensors are derived buffers (rotary
    caches): a warning on every correct sync would teach operators to ignore
    the one that matters, so `VLLMLoader` keeps it for every other layer.
    """

    def keep(record: logging.LogRecord) -> bool:
        if not record.getMessage().endswith(": Failed to load weights"):
            return True
        return layer_classes is not None and record.getMessage().split(":")[0] not in layer_classes

    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.addFilter(keep)
    try:
        yield
    finally:
        reload_logger.removeFilter(keep)


def _model_device(model: torch.nn.Module) -> torch.device | None:
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return None


class WeightLoadError(RuntimeError):
    """vLLM refused a weight; the message names it (HF name, dtype, shape) and the cause."""


class VLLMLoader:
    """Layerwise reload with an exact rollback; see the module docstring.

    `model_config` is the target's model config (the draft model's for a draft
    update); `None` means `vllm_config.model_config`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vllm_config: Any,
        model_config: Any = None,
        *,
        snapshot_to: str | None = None,
    ) -> None:
        snapshot_to = snapshot_to or os.environ.get(SNAPSHOT_ENV) or "host"
        if snapshot_to not in COPY_MODES:
            raise ValueError(
                f"{SNAPSHOT_ENV} must be one of {', '.join(COPY_MODES)}, got {snapshot_to!r}"
            )
        self.snapshot_to = snapshot_to
        self.exact_undo = snapshot_to != "none"  # "none": a failed round leaves it incomplete
        self.model = model
        self.vllm_config = vllm_config
        self.model_config = model_config if model_config is not None else vllm_config.model_config
        self.snapshot: ModelSnapshot | None = None
        self._kept: ModelSnapshot | None = None  # a committed round's, for revert()
        self._lock = threading.Lock()
        self._device: torch.device | None = None
        self._modules: list[torch.nn.Module] = []
        self._named: dict[str, torch.nn.Module] = {}
        self._experts: PrepackedExperts | None = None  # fused-MoE layers reloaded apart
        self._open = False
        # A round that reloads some layers on purpose (sparse patches): vLLM's warning
        # for the layers it loaded nothing into is dropped for every layer.
        self.partial = False

    @property
    def active(self) -> bool:
        return self._open

    def begin(self) -> None:
        """Open the round; the model keeps serving until `prepare()` (the first update)."""
        with self._lock:
            if self._open:
                raise RuntimeError("VLLMLoader.begin: a round is already open")
            self._open = True

    def prepare(self) -> None:
        """Take the snapshot and begin the layerwise reload, once per round.

        From here until the round ends the layers live on the meta device, so
        a round that never reaches an update (a start and nothing else, an
        update vLLM refuses before the engine sees it) never leaves the model
        unservable.
        """
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with self._lock:
            if not self._open:
                raise RuntimeError("VLLMLoader.prepare: no open round (begin() first)")
            if self.snapshot is not None:
                return
            self._device = _model_device(self.model)
            self._modules = list(self.model.modules())
            self._named = dict(self.model.named_modules())
            snapshot = ModelSnapshot.take(self.model, self.snapshot_to)
            try:
                initialize_layerwise_reload(self.model)
                self._experts = PrepackedExperts.take_out(self.model)
            except BaseException:
                snapshot.restore()
                snapshot.release()
                raise
            self.snapshot = snapshot
            logger.debug(
                "snapshot of %s: %.1f MB in %.4fs",
                type(self.model).__name__,
                snapshot.nbytes / 1e6,
                snapshot.seconds,
            )

    @contextlib.contextmanager
    def _load_context(self) -> Iterator[None]:
        from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with contextlib.ExitStack() as stack:
            if get_current_vllm_config_or_none() is not self.vllm_config:
                stack.enter_context(set_current_vllm_config(self.vllm_config))
            stack.enter_context(disable_mtp_completeness_check())
            if self._device is not None and self._device.type == "cuda":
                stack.enter_context(torch.cuda.device(self._device))
            yield

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load a batch; a refusal raises `WeightLoadError` naming the weight being loaded."""
        weights = list(weights)
        current: list[tuple[str, torch.Tensor]] = []

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for pair in weights:
                current[:] = [pair]
                yield pair

        self.prepare()
        with self._lock:
            if self.snapshot is None:
                raise RuntimeError("VLLMLoader.load: no open round (begin() first, or aborted)")
            try:
                with self._load_context(), timed("load"):
                    self.model.load_weights(tracked())  # type: ignore[operator]
                    self._detach_pending(weights)
            except Exception as e:
                if not current:
                    raise
                name, tensor = current[0]
                dtype = str(tensor.dtype).removeprefix("torch.")
                raise WeightLoadError(
                    f"{type(self.model).__name__} could not load {name!r} ({dtype}, shape "
                    f"{list(tensor.shape)}): {type(e).__name__}: {e}"
                ) from e

    # -- slices ------------------------------------------------------------
    @contextlib.contextmanager
    def dry_run(self) -> Iterator[DryRun]:
        """See the module docstring; the round it opens is always aborted. A model with
        fused-MoE layers whose kernel prepacks its weights is refused (`WeightLoadError`):
        a recorded slice replay cannot redo the prepack."""
        prepacked = [name for name, _ in prepacked_expert_layers(self.model)]
        if prepacked:
            raise WeightLoadError(
                f"{type(self.model).__name__}: fused-MoE layers {prepacked[:3]}"
                f"{'...' if len(prepacked) > 3 else ''} prepack their expert weights at load "
                "(vLLM's CPU kernel), which a recorded slice replay cannot redo; sync this "
                "model with a full-resync backend (wt_nccl, wt_ipc)"
            )
        self.begin()
        try:
            self.prepare()
            for module in self._modules:
                for param in module.parameters(recurse=False):
                    loader = getattr(param, "weight_loader", None)
                    while getattr(loader, "__name__", "") == "online_process_loader":
                        loader = loader.__wrapped__  # type: ignore[union-attr]
                    if loader is not None:
                        param.weight_loader = loader  # type: ignore[attr-defined]

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                with self._lock, self._load_context():
                    self.model.load_weights(iter(weights))  # type: ignore[operator]

            yield load, parameter_targets(self._named.items())
        finally:
            self.abort()

    def _armed(self, module: str) -> tuple[torch.nn.Module, Any]:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        if self.snapshot is None:
            raise RuntimeError("VLLMLoader: no open round (begin() first, or aborted)")
        layer = self._named.get(module)
        if layer is None:
            raise KeyError(f"{type(self.model).__name__} has no module named {module!r}")
        info = get_layerwise_info(layer)
        if not info.can_load():
            raise RuntimeError(f"{module!r} is not being reloaded (already processed this round?)")
        return layer, info

    def begin_module(self, module: str, zero: Iterable[str]) -> None:
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        self.prepare()
        with self._lock, self._load_context():
            layer, info = self._armed(module)
            materialize_layer(layer, info)
            for name in zero:
                getattr(layer, name).data.zero_()

    def write(self, writes: Sequence[tuple[Scatter, torch.Tensor]]) -> None:
        with self._lock:
            layers: dict[str, torch.nn.Module] = {}
            placed = []
            for scatter, src in writes:
                layer = layers.get(scatter.module)
                if layer is None:
                    layer = layers[scatter.module] = self._armed(scatter.module)[0]
                placed.append((getattr(layer, scatter.param), scatter, src))
            write_scatters(placed)

    def end_module(self, module: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process

        with self._lock, self._load_context():
            layer, info = self._armed(module)
            _layerwise_process(layer, info)

    def _detach_pending(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Replace views into `weights`' buffers held by pending layers with copies."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        storages = {
            t.untyped_storage().data_ptr()
            for _, t in weights
            if t.untyped_storage().nbytes() > t.numel() * t.element_size()
        }
        if not storages:
            return
        for module in self._modules:
            info = LAYERWISE_INFO.get(module)
            if info is None or not info.loaded_weights:
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and key != "param"
                        and value.untyped_storage().data_ptr() in storages
                    ):
                        bound.arguments[key] = value.clone()

    def commit(self, keep_undo: bool = False) -> None:
        """Finalize the reload; with `keep_undo` the snapshot is kept for `revert()`."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._lock:
            self._open = False
            snapshot, self.snapshot = self.snapshot, None
            if snapshot is None:
                return  # nothing was loaded: the model never changed
            experts, self._experts = self._experts, None
            try:
                with (
                    self._load_context(),
                    quiet_reload_warnings(None if self.partial else self._derived_only()),
                    timed("load"),
                ):
                    finalize_layerwise_reload(self.model, self.model_config)
                    if experts:
                        experts.finish()
            except BaseException:
                snapshot.restore()
                snapshot.release()
                raise
            if keep_undo:
                self._kept = snapshot
            else:
                snapshot.release()

    def revert(self) -> None:
        """Restore the kept snapshot: the model serves what it served before `begin()`."""
        with self._lock:
            kept, self._kept = self._kept, None
            if kept is None:
                raise RuntimeError("VLLMLoader.revert: no committed round was kept (keep_undo)")
            try:
                kept.restore()
            finally:
                kept.release()

    def release(self) -> None:
        with self._lock:
            kept, self._kept = self._kept, None
            if kept is not None:
                kept.release()

    def _derived_only(self) -> set[str]:
        """Class names of layers that hold buffers but no parameters (rotary caches):
        nothing of theirs travels, and the reload keeps their tensors."""
        return {
            type(m).__name__
            for m in self._modules
            if next(m.parameters(recurse=False), None) is None
            and next(m.buffers(recurse=False), None) is not None
        }

    def abort(self) -> None:
        with self._lock:
            self._open = False
            self._experts = None  # the snapshot puts their kernel tensors back
            snapshot, self.snapshot = self.snapshot, None
            if snapshot is None:
                return
            try:
                snapshot.restore()
            finally:
                snapshot.release()
            if self.snapshot_to == "none":
                logger.warning(
                    "weight update aborted with %s=none: layers completed before the failure "
                    "keep the new weights",
                    SNAPSHOT_ENV,
                )
