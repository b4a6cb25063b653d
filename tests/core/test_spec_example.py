"""The reference example (vLLM's documented custom engines), as a third-party distribution.

`tests/spec_example` holds the two documented examples, changed only where
the files say. They are laid out as an installed wheel (`wt-my-backend`, entry
points in both groups), found by both factories, and sync bit-exactly into a
real worker process (a `WorkerSession`, as vLLM's worker runs it). The reference example's
worker calls `self.model.load_weights` itself and never rolls anything back:
core's transaction does, which a failing round shows.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.core.helpers import ExampleNet, LoadingNet
from tests.harness import WorkerPool
from tests.spec_example import DIST, install_spec_example
from weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightSyncRPCError,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

MODULES = ("my_backend_trainer", "my_backend_worker")


def _forget_other_installs() -> None:
    """Drop what another test's install of the example left in this process (its
    modules, the classes the factories resolved from them)."""
    for module in MODULES:
        sys.modules.pop(module, None)
    for registry in (WeightTransferTrainerFactory.registry, WeightTransferEngineFactory.registry):
        registry._resolved.pop("my_backend", None)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    _forget_other_installs()
    site = install_spec_example(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for module in MODULES:
        sys.modules.pop(module, None)


def _trainer(site: Path, client: object, source: WeightSource, endpoint: Path) -> object:
    info_cls = WeightTransferTrainerFactory.get_engine_class("my_backend").init_info_cls
    endpoint.mkdir(exist_ok=True)
    return WeightTransferTrainerFactory.trainer_init(
        info_cls(endpoint=str(endpoint), rank=0),  # type: ignore[call-arg]
        client=client,  # type: ignore[arg-type]
        source=source,
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


class WithExtra(WeightSource):
    """A model's parameters plus one the worker's model does not have, last."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def _pairs(self) -> list[tuple[str, torch.Tensor]]:
        return [*ModuleSource(self.module), ("zzz.extra", torch.ones(2))]

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._pairs()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._pairs())


def test_both_factories_find_it_as_a_third_party_distribution(site: Path) -> None:
    trainer = WeightTransferTrainerFactory.available_backends()["my_backend"]
    engine = WeightTransferEngineFactory.available_backends()["my_backend"]
    assert trainer.distribution == engine.distribution == DIST
    assert WeightTransferEngineFactory.get_engine_class("my_backend").__name__ == (
        "MyWeightTransferEngine"
    )


def test_syncs_bit_exactly_and_a_failed_round_leaves_the_model_as_it_was(
    site: Path, tmp_path: Path
) -> None:
    with WorkerPool(
        "my_backend", 1, model_factory="tests.core.helpers:loading_net", sys_path=[str(site)]
    ) as pool:
        model = ExampleNet(seed=7)
        engine = _trainer(site, pool.client(), ModuleSource(model), tmp_path / "xfer")
        for step in range(1, 4):
            model.perturb(step)
            engine.send_weights()  # type: ignore[attr-defined]
            _assert_same_bits(pool.each("state_dict")[0], _state(model))

        # The worker's load_weights raises at the last name, after copying all the
        # others in place; the reference example's engine does nothing about it.
        before = pool.each("state_dict")[0]
        changed = ExampleNet(seed=8)
        failing = _trainer(site, pool.client(), WithExtra(changed), tmp_path / "xfer")
        with pytest.raises(WeightSyncRPCError, match=r"no parameter named 'zzz\.extra'"):
            failing.send_weights()  # type: ignore[attr-defined]
        _assert_same_bits(pool.each("state_dict")[0], before)

        # The engine now serves the second trainer: the first one's messages are refused.
        with pytest.raises(WeightSyncRPCError, match="now serves trainer"):
            engine.send_weights()  # type: ignore[attr-defined]
        _assert_same_bits(pool.each("state_dict")[0], before)
        engine = _trainer(site, pool.client(), ModuleSource(model), tmp_path / "xfer")
        engine.send_weights()  # type: ignore[attr-defined]
        _assert_same_bits(pool.each("state_dict")[0], _state(model))


def test_the_verbatim_handshake_is_refused_naming_the_missing_field(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import my_backend_trainer  # type: ignore[import-not-found]

    monkeypatch.setattr(my_backend_trainer, "SHIP_ENDPOINT", False)
    with (
        WorkerPool(
            "my_backend", 1, model_factory="tests.core.helpers:loading_net", sys_path=[str(site)]
        ) as pool,
        pytest.raises(WeightSyncRPCError) as err,
    ):
        _trainer(site, pool.client(), ModuleSource(LoadingNet()), tmp_path / "xfer")
    message = str(err.value)
    assert "missing required field 'endpoint' for MyInitInfo" in message
    assert "wire_protocol" not in message
