"""Small real pieces shared by the core tests: a worker engine that loads the
tensors it is given, its payload types and a list-backed `WeightSource`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer import (
    ParamMeta,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class EchoInitInfo(WeightTransferInitInfo):
    endpoint: str
    chunk_bytes: int = 1024
    labels: dict[str, int] = field(default_factory=dict)


@dataclass
class EchoUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    values: list[float]
    fail: bool = False
    note: str | None = None


class EchoEngine(WeightTransferEngine[EchoInitInfo, EchoUpdateInfo]):
    """Writes `values[i]` into parameter `names[i]` (filled) through the round's loader.

    Records every lifecycle call in `calls`; `fail=True` raises inside
    `receive_weights` after loading, so an abort has something to undo. It
    never touches its loader's begin / commit / abort: the base class does.
    """

    init_info_cls = EchoInitInfo
    update_info_cls = EchoUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.endpoint: str | None = None
        self.received: list[EchoUpdateInfo] = []
        self.fail_finish = False

    def init_transfer_engine(self, init_info: EchoInitInfo) -> None:
        self.calls.append("init")
        self.endpoint = init_info.endpoint

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def receive_weights(self, update_info: EchoUpdateInfo) -> None:
        self.calls.append("receive")
        self.received.append(update_info)
        params = dict(self.model.named_parameters())
        batch = [
            (n, torch.full_like(params[n], v))
            for n, v in zip(update_info.names, update_info.values, strict=True)
        ]
        self.loader.load(batch)
        if update_info.fail:
            raise RuntimeError("EchoEngine: told to fail")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")
        if self.fail_finish:
            raise RuntimeError("EchoEngine: finish failed")

    def abort_weight_update(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class TinyModel(torch.nn.Module):
    """Two parameters and a `load_weights` that copies by name."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2, 2))

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        return set(params)


class ListSource(WeightSource):
    """A source over explicit lists; iteration may be made to diverge from metadata."""

    def __init__(
        self,
        metas: list[ParamMeta],
        pairs: list[tuple[str, torch.Tensor | None]] | None = None,
        held: set[str] | None = None,
    ) -> None:
        self.metas = metas
        self.pairs = (
            pairs
            if pairs is not None
            else [(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in metas]
        )
        self.held = held
        self.passes = 0

    def metadata(self) -> list[ParamMeta]:
        return list(self.metas)

    def held_names(self) -> set[str] | None:
        return self.held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        self.passes += 1
        for name, t in self.pairs:
            if self.held is not None and name not in self.held:
                yield name, None
            else:
                yield name, t


class ExampleNet(torch.nn.Module):
    """A small real model with mixed dtypes: float32 and bfloat16 layers, an int64 parameter."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(4, 6)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(6, 6), torch.nn.Linear(6, 5, bias=False).to(torch.bfloat16)]
        )
        self.head = torch.nn.Linear(5, 3).to(torch.bfloat16)
        self.position_ids = torch.nn.Parameter(torch.arange(13) * 7, requires_grad=False)

    def perturb(self, step: int) -> None:
        """Change every parameter, differently for each `step`."""
        with torch.no_grad():
            for p in self.parameters():
                if p.dtype.is_floating_point:
                    p.mul_(-1.25).add_(0.5 * step)
                else:
                    p.add_(step)


class LoadingNet(ExampleNet):
    """`ExampleNet` whose `load_weights` copies by name and raises `KeyError` on an
    unknown name, after copying the names before it (a half-applied batch)."""

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"LoadingNet has no parameter named {name!r}")
                params[name].copy_(tensor)
        return set(params)


def loading_net() -> LoadingNet:
    return LoadingNet(seed=0)


def expected_digests(module: torch.nn.Module) -> dict[str, str]:
    from tests.harness import digest

    return {n: digest(p.detach()) for n, p in module.named_parameters()}
