"""Fused-MoE layers whose kernel repacks its weights, reloaded exactly (vLLM 0.32).

vLLM's CPU fused-MoE kernel (`CPUUnquantizedExperts`) post-processes a layer's
expert weights once, at the first load: it pads the intermediate dimension to
a multiple of 32 and prepacks `w13_weight` / `w2_weight` into its grouped-GEMM
layout, in tensors of the same shape. A layerwise reload then goes wrong for
those layers: it re-runs the layer's `UnquantizedFusedMoEMethod` post-processing
in its weight-update branch, which skips the experts' own (no padding, no
prepack), and copies the unpacked model-format tensors into the prepacked
kernel tensors. Unpadded, the shapes agree and the model silently serves the
wrong layout (every expert weight differs, tokens change even for identical
weights); padded, the copy fails mid-load.

`PrepackedExperts.take_out(model)` (after `initialize_layerwise_reload`) takes
such layers out of the reload's bookkeeping: each gets fresh model-format
tensors, which vLLM's own `load_weights` routing and expert `weight_loader`
fill, counting which experts and shards arrived. `finish()` (after
`finalize_layerwise_reload`) runs, for each layer that received all its
experts, the first load's post-processing exactly once (the method's, then the
experts' pad and prepack) and copies the result into the original kernel
tensors (same objects, same storage: generation's kernels keep their
pointers); a layer that received nothing keeps its kernel tensors untouched,
and one that received part of its experts is refused naming it. The original
tensors go back on the layer in either case. A rollback is the caller's
snapshot (it restores the original tensors and their bytes).

`prepacked_expert_layers(model)` finds them (a slice-recording backend refuses
such a model at init: it cannot replay the prepack). Version-pinned to vLLM
0.32's layerwise reload internals (`LayerReloadingInfo.kernel_tensors`,
`restore_device`, `reset`, `_get_original_loader`, `materialize_meta_tensor`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PrepackedExperts", "prepacked_expert_layers"]


def prepacked_expert_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`(name, module)` of every fused-MoE layer whose experts kernel repacks its weights
    at load (unquantized experts on vLLM's CPU kernel)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # a vLLM without these layers has none of them
        return []
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(
            experts, CPUUnquantizedExperts
        ):
            found.append((name, module))
    return found


@dataclass
class _TakenOut:
    """One layer out of the reload: its kernel tensors, and what its loaders received."""

    name: str
    module: torch.nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    non_persistent: set[str]
    fresh: list[str]
    arrived: dict[str, set[tuple[str, int]]] = field(default_factory=dict)

    def missing(self) -> str | None:
        """What a layer that received some of its experts still lacks, or None when
        it received all of them (each fresh tensor: every local expert, every shard)."""
        experts = int(getattr(self.module, "local_num_experts", 0))
        gated = bool(getattr(getattr(self.module, "moe_config", None), "is_act_and_mul", True))
        for name in self.fresh:
            shards = ("w1", "w3") if "w13" in name and gated else None
            got = self.arrived.get(name, set())
            seen = {shard for shard, _ in got}
            for shard in shards or sorted(seen) or ["?"]:
                count = len({e for s, e in got if s == shard})
                if count != experts:
                    return f"{name} shard {shard}: {count} of {experts} experts"
        return None


def _counting(loader: Any, arrived: set[tuple[str, int]]) -> Any:
    """`loader` that records each (shard_id, expert_id) it loaded."""

    @functools.wraps(loader)
    def counted(*args: Any, **kwargs: Any) -> Any:
        result = loader(*args, **kwargs)
        if result is not False:  # `return_success=True` answers False for a foreign expert
            arrived.add((str(kwargs.get("shard_id")), int(kwargs.get("expert_id", -1))))
        return result

    return counted


class PrepackedExperts:
    """The prepacked fused-MoE layers of one round; see the module docstring."""

    def __init__(self, layers: list[_TakenOut]) -> None:
        self.layers = layers

    def __bool__(self) -> bool:
        return bool(self.layers)

    @classmethod
    @torch.no_grad()
    def take_out(cls, model: torch.nn.Module) -> PrepackedExperts:
        """Take `model`'s prepacked expert layers out of the open layerwise reload."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            _get_original_loader,
            get_layerwise_info,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        taken = []
        for name, module in prepacked_expert_layers(model):
            info = get_layerwise_info(module)
            params, buffers = info.kernel_tensors
            layer = _TakenOut(
                name, module, dict(params), dict(buffers),
                set(info.kernel_non_persistent_buffers), [],
            )  # fmt: skip
            with info.restore_device:
                for tensor_name, tensor in get_layer_tensors(module).items():
                    if not tensor.is_meta:
                        continue
                    fresh = materialize_meta_tensor(tensor).zero_()
                    arrived = layer.arrived.setdefault(tensor_name, set())
                    fresh.weight_loader = _counting(_get_original_loader(tensor), arrived)
                    setattr(module, tensor_name, fresh)
                    layer.fresh.append(tensor_name)
            info.reset()  # the reload no longer tracks it: finalize passes it by
            taken.append(layer)
        return cls(taken)

    @torch.no_grad()
    def finish(self) -> None:
        """Post-process and install every layer that received all its experts; put
        every layer's kernel tensors back. Raises naming a layer that got only part."""
        try:
            for layer in self.layers:
                if not any(layer.arrived.values()):
                    continue  # nothing of this layer came this round: it keeps its weights
                missing = layer.missing()
                if missing is not None:
                    raise ValueError(
                        f"{layer.name}: this round loaded part of the layer's experts ({missing}); "
                        "a fused-MoE layer whose kernel prepacks its weights takes all of them "
                        "in one round"
                    )
                self._install(layer)
        finally:
            for layer in self.layers:
                self._put_back(layer)
            self.layers = []

    @staticmethod
    def _install(layer: _TakenOut) -> None:
        module = layer.module
        method: Any = module.quant_method
        method.process_weights_after_loading(module)  # its weight-update branch
        method.moe_kernel.fused_experts.process_weights_after_loading(module)  # pad, prepack
        for name, kernel in layer.params.items():
            new = getattr(module, name)
            layout = (kernel.shape, kernel.dtype, kernel.stride())
            if (new.shape, new.dtype, new.stride()) != layout:
                raise RuntimeError(
                    f"{layer.name}.{name}: the processed weights ({new.dtype}, {list(new.shape)}) "
                    f"do not fit the kernel tensor ({kernel.dtype}, {list(kernel.shape)})"
                )
            kernel.data.copy_(new)
        for name, kernel in layer.buffers.items():
            new = module._buffers.get(name)
            if new is not None and not new.is_meta:
                kernel.data.copy_(new)

    @staticmethod
    def _put_back(layer: _TakenOut) -> None:
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        module = layer.module
        for name in list(get_layer_tensors(module)):
            delattr(module, name)
        for name, kernel in layer.params.items():
            module.register_parameter(name, kernel)  # type: ignore[arg-type]
        for name, kernel in layer.buffers.items():
            module.register_buffer(name, kernel, persistent=name not in layer.non_persistent)
