"""The weights and the worker model the conformance suite syncs, and its sources."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weight_transfer.source import ParamMeta, WeightSource

__all__ = [
    "ConformanceModel",
    "DisagreeingSource",
    "Source033",
    "TensorSource",
    "conformance_model",
    "conformance_weights",
    "mixed_weights",
]

DISAGREEMENTS = ("reorder", "redtype", "reshape", "missing", "extra", "rename")
BIG_NUMEL = 3000  # one 12 KB tensor: split over a small-buffer wire mode's buckets


def mixed_weights(seed: int, *, layers: int = 3, big_numel: int = 0) -> dict[str, torch.Tensor]:
    """A layered model's fp32/bf16/fp16/int64/int8 tensors with odd sizes, from `seed`.

    `big_numel` adds one float32 tensor of that many elements in the middle layer.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(37, 16, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "attn.qkv.weight"] = torch.randn(48, 16, generator=g).to(torch.bfloat16)
        out[p + "attn.o.weight"] = torch.randn(16, 16, generator=g).to(torch.float16)
        out[p + "mlp.up.weight"] = torch.randn(33, 16, generator=g)
        out[p + "mlp.down.bias"] = torch.randn(7, generator=g).to(torch.bfloat16)
        out[p + "router.counts"] = torch.randint(-(2**40), 2**40, (5,), generator=g)
        out[p + "mask"] = torch.randint(0, 2, (3, 3), generator=g).to(torch.int8)
        if big_numel and i == layers // 2:
            out[p + "mlp.big.weight"] = torch.randn(big_numel, generator=g)
    out["model.norm.weight"] = torch.randn(16, generator=g).to(torch.bfloat16)
    out["lm_head.weight"] = torch.randn(37, 16, generator=g)
    return out


class ConformanceModel(torch.nn.Module):
    """Parameters named as `mixed_weights` names them, and a `load_weights` by name.

    `fail_on`: a name whose arrival raises, after the names before it in the same
    call were copied (a half-applied batch the loader must roll back).
    `load_delay_s`: a sleep per `load_weights` call (to widen a window).
    """

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.fail_on: str | None = None
        self.load_delay_s = 0.0
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, tensor in weights.items():
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            param = torch.nn.Parameter(tensor.clone(), requires_grad=False)
            module.register_parameter(leaf, param)
            self._params[name] = param

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name == self.fail_on:
                    raise ValueError(f"ConformanceModel: told to fail on {name!r}")
                self._params[name].copy_(tensor)
                loaded.add(name)
        return loaded


def conformance_weights(seed: int) -> dict[str, torch.Tensor]:
    """The weights the conformance suite syncs: `mixed_weights` with one big tensor."""
    return mixed_weights(seed, big_numel=BIG_NUMEL)


def conformance_model() -> ConformanceModel:
    """The model every conformance worker holds (`conformance_weights`' shapes)."""
    return ConformanceModel(conformance_weights(0))


class TensorSource(WeightSource):
    """Yields the tensors of an ordered dict; metadata from the same dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()

    def set(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take `tensors`' values, in place (the names and shapes stay)."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.tensors[name].copy_(tensor)


class DisagreeingSource(TensorSource):
    """Metadata from `tensors`; iteration altered by `how` at parameter `at`, while
    `how` is set (None: agrees).

    `how`: "reorder" (swap `at` and `at + 1`), "redtype", "reshape", "missing"
    (stop before `at`), "extra" (one more tensor after the last), "rename".
    """

    def __init__(self, tensors: dict[str, torch.Tensor], how: str | None = None, at: int = 0):
        super().__init__(tensors)
        self.how = how
        self.at = at

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from altered(self.tensors, self.how, self.at)


class Source033(WeightSource):
    """A source written the way vLLM 0.33's docs write one: `metadata` a cached
    property, `iter_full()` and nothing else; `how` / `at` alter iteration as
    `DisagreeingSource`'s do."""

    def __init__(self, tensors: dict[str, torch.Tensor], how: str | None = None, at: int = 0):
        self.tensors = tensors
        self.how = how
        self.at = at

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from altered(self.tensors, self.how, self.at)

    def set(self, tensors: dict[str, torch.Tensor]) -> None:
        TensorSource.set(self, tensors)  # type: ignore[arg-type]


def altered(
    tensors: dict[str, torch.Tensor], how: str | None, at: int
) -> list[tuple[str, torch.Tensor]]:
    """`tensors`' items altered by `how` at `at` (`DisagreeingSource`)."""
    items: list[tuple[str, Any]] = list(tensors.items())
    if how == "reorder":
        items[at], items[at + 1] = items[at + 1], items[at]
    elif how == "redtype":
        items[at] = (items[at][0], items[at][1].to(torch.float64))
    elif how == "reshape":
        items[at] = (items[at][0], items[at][1].reshape(1, -1))
    elif how == "missing":
        items = items[:at]
    elif how == "extra":
        items.append(("surplus.weight", torch.zeros(3)))
    elif how == "rename":
        items[at] = (items[at][0] + ".renamed", items[at][1])
    return items
