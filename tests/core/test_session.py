"""`WorkerSession`: the worker-side state machine around a real engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.core.helpers import EchoEngine, TinyModel
from weight_transfer import (
    VLLMWeightSyncClient,
    WeightTransferConfig,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
    WorkerPosition,
    WorkerSession,
)
from weight_transfer.payload import WIRE_PROTOCOL_VERSION

INIT = {"wire_protocol": WIRE_PROTOCOL_VERSION, "endpoint": "tcp://127.0.0.1:9"}


def _session(position: WorkerPosition | None = None, draft: Any = None) -> WorkerSession:
    """A session whose engine a trainer connected to; its `calls` start empty."""
    engine = EchoEngine(WeightTransferConfig("echo"), position, "cpu", TinyModel())
    session = WorkerSession(engine, draft_model=draft)
    session.init_weight_transfer_engine(INIT)
    engine.calls.clear()
    return session


def _engine(s: WorkerSession) -> EchoEngine:
    assert isinstance(s.engine.backend, EchoEngine)
    return s.engine.backend


def test_a_full_round_and_weight_version() -> None:
    s = _session()
    assert isinstance(s, VLLMWeightSyncClient)
    s.init_weight_transfer_engine(INIT)
    s.init_weight_transfer_engine(WeightTransferInitRequest(INIT))
    assert _engine(s).endpoint == "tcp://127.0.0.1:9"
    s.start_weight_update()
    assert s.active
    s.update_weights({"names": ["a"], "values": [2.0]})
    s.update_weights(WeightTransferUpdateRequest({"names": ["b"], "values": [3.0]}))
    s.finish_weight_update("v1")
    assert not s.active and s.weight_version == "v1"
    s.start_weight_update()
    s.finish_weight_update()
    assert s.weight_version == "v1"  # None keeps the previous version
    assert _engine(s).calls == [
        "init",
        "init",
        "start",
        "receive",
        "receive",
        "finish",
        "start",
        "finish",
    ]
    assert torch.equal(s.engine.model.b, torch.full((2, 2), 3.0))


def test_start_twice_is_refused() -> None:
    s = _session()
    s.start_weight_update()
    with pytest.raises(
        RuntimeError, match="start_weight_update called while a weight update is active"
    ):
        s.start_weight_update()
    assert s.active and _engine(s).calls == ["start"]


def test_update_and_finish_need_an_open_round() -> None:
    s = _session()
    with pytest.raises(
        RuntimeError, match="start_weight_update must be called before update_weights"
    ):
        s.update_weights({"names": ["a"], "values": [1.0]})
    with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
        s.finish_weight_update()
    assert _engine(s).calls == []


def test_failed_update_closes_the_round_and_rolls_back() -> None:
    s = _session()
    s.start_weight_update()
    s.update_weights({"names": ["a"], "values": [5.0]})
    with pytest.raises(RuntimeError, match="told to fail"):
        s.update_weights({"names": ["b"], "values": [6.0], "fail": True})
    assert not s.active
    assert torch.equal(s.engine.model.a, torch.zeros(3))
    with pytest.raises(RuntimeError, match="without a matching start"):
        s.finish_weight_update()
    s.start_weight_update()  # a new round may open
    s.update_weights({"names": ["a"], "values": [1.0]})
    s.finish_weight_update()
    assert torch.equal(s.engine.model.a, torch.ones(3))


def test_failed_finish_aborts_and_closes_the_round() -> None:
    s = _session()
    _engine(s).fail_finish = True
    s.start_weight_update()
    s.update_weights({"names": ["a"], "values": [5.0]})
    with pytest.raises(RuntimeError, match="finish failed"):
        s.finish_weight_update("v9")
    assert not s.active and s.weight_version is None
    assert _engine(s).calls[-2:] == ["finish", "abort"]
    assert torch.equal(s.engine.model.a, torch.zeros(3))


def test_shutdown_during_a_round_is_refused() -> None:
    s = _session()
    s.start_weight_update()
    with pytest.raises(
        RuntimeError, match="cannot shut the weight transfer engine down during an update"
    ):
        s.shutdown_weight_transfer_engine()
    s.finish_weight_update()
    s.shutdown_weight_transfer_engine()
    assert _engine(s).calls[-1] == "shutdown"


def test_update_info_list_is_indexed_by_global_index() -> None:
    position = WorkerPosition(rank=1, world_size=2, data_parallel_index=1, data_parallel_size=2)
    s = _session(position)
    infos = [{"names": ["a"], "values": [float(i)]} for i in range(position.total_workers)]
    s.start_weight_update()
    s.update_weights(infos)
    s.update_weights(WeightTransferUpdateRequest(infos))
    s.finish_weight_update()
    assert [r.values for r in _engine(s).received] == [[3.0], [3.0]]
    assert torch.equal(s.engine.model.a, torch.full((3,), 3.0))


def test_draft_round_targets_the_draft_model_then_resets() -> None:
    draft = TinyModel()
    s = _session(draft=draft)
    main_model = s.engine.model
    s.start_draft_weight_update()
    assert s.engine.model is draft
    s.update_weights({"names": ["a"], "values": [4.0]})
    s.finish_weight_update()
    assert s.engine.model is main_model
    assert torch.equal(draft.a, torch.full((3,), 4.0))
    assert torch.equal(main_model.a, torch.zeros(3))


def test_draft_round_refusals() -> None:
    with pytest.raises(RuntimeError, match="there is no draft model"):
        _session().start_draft_weight_update()

    class NoDraft(EchoEngine):
        supports_draft_weight_update = False

    s = WorkerSession(NoDraft(WeightTransferConfig("x"), None, "cpu", TinyModel()), TinyModel())
    with pytest.raises(RuntimeError, match="NoDraft does not support draft-model updates"):
        s.start_draft_weight_update()
    assert not s.active


def test_failed_draft_update_resets_the_target() -> None:
    draft = TinyModel()
    s = _session(draft=draft)
    main_model = s.engine.model
    s.start_draft_weight_update()
    with pytest.raises(RuntimeError):
        s.update_weights({"names": ["a"], "values": [1.0], "fail": True})
    assert s.engine.model is main_model
