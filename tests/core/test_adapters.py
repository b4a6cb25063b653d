"""LoRA adapter rounds in wt-core (`weight_transfer.runtime.adapters`): the PEFT
source, the adapter control, and how a worker's round is retargeted by it.

The vLLM side (adapters kept in vLLM's LoRA manager) runs against live engines in
`tests/vllm/test_lora.py`; here the host's adapter loader is an in-memory store.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.core.helpers import EchoEngine, TinyModel
from tests.core.test_session import INIT
from weight_transfer import (
    Adapter,
    LoRASource,
    WeightTransferConfig,
    WorkerPosition,
    WorkerSession,
)
from weight_transfer.runtime import hosts
from weight_transfer.runtime.adapters import ADAPTER_FIELD
from weight_transfer.runtime.direct_loader import DirectLoader
from weight_transfer.runtime.round_client import RoundClient

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def _peft(*names: str) -> Any:
    peft = pytest.importorskip("peft")
    from wt_tools.tiny_model import tiny_llama

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(seed=1), config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    return model


def test_the_source_yields_what_peft_saves_bit_exactly() -> None:
    peft = pytest.importorskip("peft")
    model = _peft("alpha", "beta")
    source = LoRASource(model, "alpha", name="served-alpha")
    for adapter_name, served in (("alpha", "served-alpha"), ("beta", "beta")):
        if adapter_name == "beta":
            source.select("beta")
        saved = peft.get_peft_model_state_dict(model, adapter_name=adapter_name)
        sent = dict(iter(source))
        assert sent.keys() == saved.keys() and len(sent) == 8  # 2 layers x q, v x A, B
        assert all(torch.equal(sent[n], saved[n]) for n in saved)
        assert [m.name for m in source.metadata()] == list(sent)
        assert source.nbytes == sum(t.numel() * t.element_size() for t in saved.values())
        assert source.adapter.name == served
        assert source.adapter.config["r"] == 4 and source.adapter.config["lora_alpha"] == 8
        assert source.adapter.config["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(
        ValueError, match=r"no PEFT adapter 'gamma' \(its adapters: \['alpha', 'beta'\]\)"
    ):
        source.select("gamma")
    with pytest.raises(ValueError, match="not a PEFT model"):
        LoRASource(TinyModel())


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ("alpha", "'wt_adapter' must be a dict"),
        ({"name": "a/b", "config": CONFIG}, "field 'name'"),
        ({"name": "a", "config": {**CONFIG, "r": "4"}}, r"field 'config\.r'"),
        ({"name": "a", "config": {"r": 4, "lora_alpha": 8}}, r"field 'config\.target_modules'"),
        ({"name": "a", "config": CONFIG, "remove": "yes"}, "field 'remove'"),
        ({"name": "a", "config": CONFIG, "rank": 4}, r"unknown field\(s\) \['rank'\]"),
    ],
)
def test_a_malformed_adapter_control_names_the_field(payload: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Adapter.from_payload(payload)


class StoreLoader:
    """A host's adapter loader over an in-memory store: stages, installs at commit."""

    def __init__(self, store: dict[str, dict[str, torch.Tensor]], adapter: Adapter) -> None:
        self.store, self.adapter, self.staged = store, adapter, {}

    def begin(self) -> None:
        pass

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.staged.update({n: t.clone() for n, t in weights})

    def commit(self) -> None:
        if self.adapter.remove:
            del self.store[self.adapter.name]
        else:
            self.store[self.adapter.name] = self.staged

    def abort(self) -> None:
        self.staged = {}


class AdapterHost:
    """A host that owns one engine's configuration and keeps its adapters in memory."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.store: dict[str, dict[str, torch.Tensor]] = {}

    def owns(self, vllm_config: Any) -> bool:
        return vllm_config is self.config

    def loader(self, model: Any, vllm_config: Any, model_config: Any) -> DirectLoader:
        return DirectLoader(model)

    def adapter_loader(self, model: Any, vllm_config: Any, adapter: Adapter) -> StoreLoader:
        return StoreLoader(self.store, adapter)

    def generation(self) -> None:
        return None


def _session(monkeypatch: pytest.MonkeyPatch, *, host: bool = True) -> tuple[WorkerSession, Any]:
    config = WorkerPosition()
    engine = EchoEngine(WeightTransferConfig("echo"), config, "cpu", TinyModel())
    adapters = AdapterHost(config)
    monkeypatch.setattr(hosts, "_hosts", [adapters] if host else [])
    session = WorkerSession(engine)
    session.init_weight_transfer_engine(INIT)
    return session, adapters


TARGET = {ADAPTER_FIELD: {"name": "alpha", "config": CONFIG}}


def test_an_adapter_round_loads_into_the_adapter_and_leaves_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session, host = _session(monkeypatch)
    session.start_weight_update()
    session.update_weights(TARGET)
    session.update_weights({"names": ["b"], "values": [3.0]})
    session.finish_weight_update()
    assert torch.equal(host.store["alpha"]["b"], torch.full((2, 2), 3.0))
    assert torch.equal(session.engine.model.b, torch.zeros(2, 2))  # the model is untouched
    # a failed adapter round keeps the adapter it had
    session.start_weight_update()
    session.update_weights(TARGET)
    with pytest.raises(RuntimeError, match="told to fail"):
        session.update_weights({"names": ["b"], "values": [4.0], "fail": True})
    assert torch.equal(host.store["alpha"]["b"], torch.full((2, 2), 3.0))
    # a removal round loads nothing and removes it
    session.start_weight_update()
    session.update_weights({ADAPTER_FIELD: {"name": "alpha", "remove": True}})
    session.finish_weight_update()
    assert host.store == {}
    # the next model round loads the model again
    session.start_weight_update()
    session.update_weights({"names": ["a"], "values": [1.0]})
    session.finish_weight_update()
    assert torch.equal(session.engine.model.a, torch.ones(3))


def test_an_adapter_control_after_a_load_or_without_a_host_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session, host = _session(monkeypatch)
    session.start_weight_update()
    session.update_weights({"names": ["a"], "values": [2.0]})
    with pytest.raises(RuntimeError, match="must come before the round's first load"):
        session.update_weights(TARGET)
    assert not session.active and host.store == {}
    assert torch.equal(session.engine.model.a, torch.zeros(3))  # the round rolled back
    bare, _ = _session(monkeypatch, host=False)
    bare.start_weight_update()
    with pytest.raises(TypeError, match="this host cannot take a LoRA adapter round"):
        bare.update_weights(TARGET)
    assert not bare.active


def test_a_backend_that_cannot_carry_adapters_refuses_one_on_both_sides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session, host = _session(monkeypatch)
    monkeypatch.setattr(type(session.engine.backend), "supports_adapter_update", False)
    session.start_weight_update()
    with pytest.raises(TypeError, match="EchoEngine cannot take a LoRA adapter round"):
        session.update_weights(TARGET)
    assert host.store == {}

    from weight_transfer import TrainerWeightTransferEngine

    class NoAdapters(TrainerWeightTransferEngine[Any]):
        sends_adapters = False

        @property
        def backend(self) -> str:
            return "no-adapters"

        @classmethod
        def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Any:
            return cls(client=client, source=source)

        def send_weights(self) -> None:
            pass

    with pytest.raises(ValueError, match="no-adapters cannot send a LoRA adapter"):
        NoAdapters.trainer_init(None, client=session, source=LoRASource(_peft("alpha"), "alpha"))


def test_the_round_client_targets_every_round_at_the_source_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session, host = _session(monkeypatch)
    source = LoRASource(_peft("alpha", "beta"), "alpha")
    client = RoundClient(session)
    client.adapter_source = source
    for name in ("alpha", "beta"):
        source.select(name)
        client.start_weight_update()
        client.update_weights({"names": ["b"], "values": [5.0]})
        client.finish_weight_update()
    assert sorted(host.store) == ["alpha", "beta"]
    client.adapter_round(Adapter("alpha", remove=True))
    assert sorted(host.store) == ["beta"]
