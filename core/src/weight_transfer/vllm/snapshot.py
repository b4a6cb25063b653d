"""An exact undo record of everything a layerwise reload changes in a vLLM model.

Layerwise reload (`initialize_layerwise_reload` ... `finalize_layerwise_reload`)
moves every layer to the meta device, wraps weight loaders, and, as each layer
completes, processes the new weights and copies them into the layer's original
("kernel") tensors. Some quantization and CPU kernels also replace plain module
attributes: on CPU, unquantized Linear layers keep their packed GEMM weights in
a `cpu_linear` attribute and leave `weight` empty. Finalizing a failed reload
therefore cannot bring the previous weights back.

`ModelSnapshot.take(model)`, called before `initialize_layerwise_reload`,
records per module the parameter and buffer dicts, the non-persistent buffer
set and every other instance attribute (by reference), plus a copy of the data
of every non-empty kernel tensor. `restore()` puts all of it back and resets the
reload bookkeeping, so the model serves exactly what it served before `take`.

Cost: one copy of the kernel tensors' bytes per round (on CPU only the tensors
that stay materialized: embeddings, norms, lm_head; Linear weights live in the
`cpu_linear` objects, which are kept alive by reference instead, so peak memory
holds the old and new packed Linear weights until the round ends). Copy
buffers are kept per model and reused in later rounds, so only the first round
pays for allocation. Where the copy lives (`copy_to`):

- `"host"` (default): CUDA tensors are copied to pinned host memory;
- `"device"`: next to each tensor (fast, but costs device memory);
- `"none"`: no data copy. `restore()` still puts every module back together,
  but layers that completed before the failure keep the new values: a failed
  round leaves whole layers of the new weights (the engine then keeps
  generation paused until a complete round lands).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.runtime.phases import timed

__all__ = ["ModelSnapshot", "COPY_MODES", "UndoCost", "last_undo_cost"]

COPY_MODES = ("host", "device", "none")

_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})

# Reused copy buffers per model, keyed by "<module path>|<p or b>|<name>".
_COPY_BUFFERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class UndoCost:
    """What a model's last snapshot cost: the seconds it took, the bytes it copied,
    and the bytes it kept alive by reference (on CPU the previous packed Linear
    weights), all held until the round ends; `model_bytes` (every tensor the
    modules hold: parameters, buffers, and those of their other attributes) for scale."""

    seconds: float
    copied_bytes: int
    kept_bytes: int
    model_bytes: int


_LAST_COST: weakref.WeakKeyDictionary[torch.nn.Module, UndoCost] = weakref.WeakKeyDictionary()


def last_undo_cost(model: torch.nn.Module) -> UndoCost | None:
    """The cost of the last `ModelSnapshot.take(model)`, or None before the first."""
    return _LAST_COST.get(model)


def _tensor_bytes(values: Any, seen: set[int]) -> int:
    """Bytes of the tensors among `values` and their objects' attributes (one level),
    each storage counted once."""
    total = 0
    for value in values:
        found = [value] if isinstance(value, torch.Tensor) else []
        if not found and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            found = [v for v in vars(value).values() if isinstance(v, torch.Tensor)]
        for tensor in found:
            if tensor.is_meta or tensor.numel() == 0:
                continue
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total


@dataclass
class _ModuleState:
    module: torch.nn.Module
    parameters: dict[str, Any]
    buffers: dict[str, Any]
    attributes: dict[str, Any]


def _copy_buffer(
    store: dict[str, torch.Tensor], key: str, tensor: torch.Tensor, copy_to: str
) -> torch.Tensor:
    """A reusable buffer shaped like `tensor`: pinned host memory for a CUDA
    tensor with `copy_to == "host"`, else on the tensor's device."""
    pinned = copy_to == "host" and tensor.device.type == "cuda"
    device = torch.device("cpu") if pinned else tensor.device
    buf = store.get(key)
    if (
        buf is None
        or buf.shape != tensor.shape
        or buf.dtype != tensor.dtype
        or buf.device != device
    ):
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pinned)
        store[key] = buf
    return buf


def _synchronize(tensors: list[torch.Tensor]) -> None:
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


class ModelSnapshot:
    """See the module docstring. `nbytes` and `seconds` describe the data copy."""

    def __init__(
        self,
        model: torch.nn.Module,
        states: list[_ModuleState],
        data: list[tuple[torch.Tensor, torch.Tensor]],
        seconds: float,
    ) -> None:
        self.model = model
        self._states = states
        self._data = data
        self.nbytes = sum(saved.numel() * saved.element_size() for _, saved in data)
        self.seconds = seconds

    @classmethod
    @torch.no_grad()
    def take(cls, model: torch.nn.Module, copy_to: str = "host") -> ModelSnapshot:
        """Record `model`; must run before `initialize_layerwise_reload(model)`."""
        if copy_to not in COPY_MODES:
            raise ValueError(f"copy_to must be one of {COPY_MODES}, got {copy_to!r}")
        with timed("undo"):
            return cls._take(model, copy_to)

    @classmethod
    def _take(cls, model: torch.nn.Module, copy_to: str) -> ModelSnapshot:
        t0 = time.perf_counter()
        store = _COPY_BUFFERS.setdefault(model, {})
        states: list[_ModuleState] = []
        data: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for path, module in model.named_modules(remove_duplicate=False):
            attributes = {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}
            attributes["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
            state = _ModuleState(
                module, dict(module._parameters), dict(module._buffers), attributes
            )
            states.append(state)
            for kind, tensors in (("p", state.parameters), ("b", state.buffers)):
                for name, tensor in tensors.items():
                    if copy_to == "none" or tensor is None or tensor.is_meta:
                        continue
                    if tensor.numel() == 0:
                        continue
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    buf = _copy_buffer(store, f"{path}|{kind}|{name}", tensor, copy_to)
                    buf.copy_(tensor.detach(), non_blocking=buf.is_pinned())
                    data.append((tensor, buf))
        _synchronize([t for t, _ in data])
        snapshot = cls(model, states, data, time.perf_counter() - t0)
        storages: set[int] = set()
        model_bytes = _tensor_bytes(
            [t for st in states for t in (*st.parameters.values(), *st.buffers.values())],
            storages,
        )
        kept = _tensor_bytes([v for st in states for v in st.attributes.values()], storages)
        _LAST_COST[model] = UndoCost(snapshot.seconds, snapshot.nbytes, kept, model_bytes + kept)
        return snapshot

    @torch.no_grad()
    def restore(self) -> None:
        """Put the model back exactly as it was at `take`, discarding reload state."""
        from vllm.model_executor.model_loader.reload import layerwise

        for state in self._states:
            module = state.module
            module._parameters.clear()
            module._parameters.update(state.parameters)
            module._buffers.clear()
            module._buffers.update(state.buffers)
            for key in [
                k
                for k in module.__dict__
                if k not in _MODULE_INTERNALS and k not in state.attributes
            ]:
                del module.__dict__[key]
            module.__dict__.update(state.attributes)
            module._non_persistent_buffers_set = set(
                state.attributes["_non_persistent_buffers_set"]
            )
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is not None:
                info.reset()
            for tensor in (*state.parameters.values(), *state.buffers.values()):
                if tensor is not None and hasattr(tensor, "weight_loader"):
                    tensor.weight_loader = layerwise._get_original_loader(tensor)
        for tensor, saved in self._data:
            tensor.data.copy_(saved, non_blocking=saved.is_pinned())
        _synchronize([t for t, _ in self._data])
        layerwise.LOADING_LAYERS.clear()

    def release(self) -> None:
        """Drop the references this snapshot holds (the copy buffers stay for reuse)."""
        self._states = []
        self._data = []
