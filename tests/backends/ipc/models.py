"""A plain `nn.Module` holding `mixed_tensors`' parameters under the same names (built in
worker processes: core's `DirectLoader` loads it by name and rolls it back on failure)."""

from __future__ import annotations

import torch

from tests.sources import mixed_tensors

BIG = 3000


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    return root


def mixed_model() -> torch.nn.Module:
    """Starts from `mixed_tensors(0, big_numel=BIG)`."""
    return module_of(mixed_tensors(0, big_numel=BIG))
