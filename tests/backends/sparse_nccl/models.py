"""Small deterministic models for `sparse_nccl` tests (built inside worker processes too)."""

from __future__ import annotations

import torch

SEED = 20240611


class PatchableModel(torch.nn.Module):
    """fp32, bf16 and fp16 parameters whose names match their HF names 1:1."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(SEED)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 12), torch.nn.Linear(12, 8)])
        self.mixed = torch.nn.Module()
        self.mixed.register_parameter(
            "bf16_weight", torch.nn.Parameter(torch.randn(8, 10, generator=g).to(torch.bfloat16))
        )
        self.mixed.register_parameter(
            "fp16_weight", torch.nn.Parameter(torch.randn(6, 7, generator=g).to(torch.float16))
        )
        with torch.no_grad():
            for layer in self.layers:
                assert isinstance(layer, torch.nn.Linear)
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))


def make_model() -> PatchableModel:
    return PatchableModel()


def initial_state() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in make_model().named_parameters()}


class MethodModel(torch.nn.Module):
    """Holds one tensor under an internal name and patches it through its own methods.

    HF name `"w"` maps to the buffer `store`; `check_sparse_patch` refuses other names.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("store", torch.arange(12, dtype=torch.float32))
        self.calls = 0

    def check_sparse_patch(
        self, name: str, full_shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        if name != "w" or full_shape != (12,) or dtype != torch.float32:
            raise ValueError(f"cannot patch {name!r} {full_shape} {dtype}")

    def apply_sparse_patch(
        self, name: str, indices: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        self.calls += 1
        index = indices.long()
        old = self.store[index].clone()
        self.store[index] = values
        return old
