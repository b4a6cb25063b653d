"""Weight sources for tests: explicit tensors, and sources that break the contract on purpose."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from weight_transfer import ParamMeta, WeightSource


class DictSource(WeightSource):
    """Yields the tensors of an ordered dict; metadata from the same dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


class DisagreeingSource(DictSource):
    """Metadata from `tensors`; iteration altered by `how` at parameter `at`.

    `how`: "reorder" (swap `at` and `at + 1`), "redtype", "reshape", "missing"
    (stop before `at`), "extra" (one more tensor after the last), "rename".
    """

    def __init__(self, tensors: dict[str, torch.Tensor], how: str, at: int) -> None:
        super().__init__(tensors)
        self.how = how
        self.at = at

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        items = list(self.tensors.items())
        if self.how == "reorder":
            items[self.at], items[self.at + 1] = items[self.at + 1], items[self.at]
        elif self.how == "redtype":
            name, t = items[self.at]
            items[self.at] = (name, t.to(torch.float64))
        elif self.how == "reshape":
            name, t = items[self.at]
            items[self.at] = (name, t.reshape(1, -1))
        elif self.how == "missing":
            items = items[: self.at]
        elif self.how == "extra":
            items.append(("surplus.weight", torch.zeros(3)))
        elif self.how == "rename":
            name, t = items[self.at]
            items[self.at] = (name + ".renamed", t)
        yield from items


def mixed_tensors(seed: int, *, layers: int = 3, big_numel: int = 0) -> dict[str, torch.Tensor]:
    """A layered model's worth of fp32/bf16/fp16/int tensors with odd sizes.

    `big_numel` adds one float32 tensor of that many elements in the middle layer.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=g),
    }
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


class StallingSource(DictSource):
    """Yields `stall_at` tensors, sets the event `stalled`, then hangs (a trainer stuck, or
    about to be killed, in the middle of a round)."""

    def __init__(self, tensors: dict[str, torch.Tensor], stall_at: int, stalled: Any) -> None:
        super().__init__(tensors)
        self.stall_at = stall_at
        self.stalled = stalled

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self.tensors.items()):
            if i == self.stall_at:
                self.stalled.set()
                time.sleep(600)
            yield pair


def dtensor_model(rank: int, group_port: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Join a 2-rank gloo default group as `rank`; a two-Linear model whose parameters
    are DTensors sharded on dim 0, and its full weights (the same on both ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for mod in model:
        for pname, p in list(mod.named_parameters()):
            setattr(mod, pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model, full
