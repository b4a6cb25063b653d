"""`TrainerInitInfo`, the `WeightTransferEngine` base class, `WorkerPosition`, `DirectLoader`."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from tests.core.helpers import EchoEngine, EchoInitInfo, TinyModel
from weight_transfer import (
    TrainerInitInfo,
    WeightTransferConfig,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
    WorkerPosition,
    WorkerSession,
    __version__,
)
from weight_transfer.base import ABORT_FIELD, RoundAbortedError
from weight_transfer.loading import loader_for
from weight_transfer.payload import (
    WIRE_PROTOCOL_VERSION,
    ProtocolMismatchError,
    WireProtocolInfo,
    check_wire_protocol,
)
from weight_transfer.position import worker_position
from weight_transfer.runtime.devices import synchronize_device
from weight_transfer.runtime.direct_loader import DirectLoader
from weight_transfer.runtime.worker_round import GuardedEngine, guarded

# ------------------------------------------------------------- TrainerInitInfo


@dataclasses.dataclass
class _MyInfo(TrainerInitInfo):
    backend: ClassVar[str] = "my_backend"

    endpoint: str  # positional field after the base's keyword-only rank
    size: int = 4


def test_trainer_init_info_subclass_without_backend_raises_at_definition() -> None:
    with pytest.raises(TypeError, match=r"NoBackend must set the ClassVar `backend`"):

        @dataclasses.dataclass
        class NoBackend(TrainerInitInfo):
            endpoint: str = ""

    with pytest.raises(TypeError, match="EmptyBackend"):

        @dataclasses.dataclass
        class EmptyBackend(TrainerInitInfo):
            backend: ClassVar[str] = ""


def test_trainer_init_info_rank_is_keyword_only_and_backend_not_a_field() -> None:
    info = _MyInfo("tcp://x", rank=2)
    assert (info.endpoint, info.size, info.rank, info.backend) == ("tcp://x", 4, 2, "my_backend")
    assert "backend" not in {f.name for f in dataclasses.fields(info)}
    with pytest.raises(TypeError):
        _MyInfo("tcp://x", 4, 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        _MyInfo("tcp://x")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _MyInfo("tcp://x", rank=0, backend="other")  # type: ignore[call-arg]


def test_is_sender_only_for_rank_zero() -> None:
    assert [_MyInfo("e", rank=r).is_sender for r in range(3)] == [True, False, False]


# --------------------------------------------------------- the engine base


def _engine(vllm_config: Any = None, device: str = "cpu") -> GuardedEngine:
    """An engine a trainer connected to, inside core's round; its `calls` start empty."""
    return _connected(EchoEngine(WeightTransferConfig("echo"), vllm_config, device, TinyModel()))


def _connected(backend: EchoEngine | GuardedEngine) -> GuardedEngine:
    engine = guarded(backend)
    engine.init_transfer_engine(engine.parse_init_info(_init()))
    engine.calls.clear()
    return engine


@dataclasses.dataclass
class _WiredInfo(WireProtocolInfo, EchoInitInfo):
    """An init info that declares core's wire protocol."""


class _WiredEngine(EchoEngine):
    init_info_cls = _WiredInfo


def _wired() -> GuardedEngine:
    return guarded(_WiredEngine(WeightTransferConfig("echo"), None, "cpu", TinyModel()))


def _init(**extra: Any) -> dict[str, Any]:
    return {"wire_protocol": WIRE_PROTOCOL_VERSION, "endpoint": "tcp://127.0.0.1:1", **extra}


def test_parse_init_info_builds_the_typed_dataclass() -> None:
    info = _engine().parse_init_info(_init(chunk_bytes=64, labels={"a": 1}))
    assert (info.endpoint, info.chunk_bytes, info.labels) == ("tcp://127.0.0.1:1", 64, {"a": 1})
    wired = _wired().parse_init_info(_init())
    assert wired.wire_protocol == WIRE_PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("payload", "pattern"),
    [
        (_init(chunk_size=4), r"init_info: unknown field 'chunk_size' for EchoInitInfo"),
        ({"wire_protocol": WIRE_PROTOCOL_VERSION}, r"missing required field 'endpoint'"),
        (_init(chunk_bytes="64"), r"field 'chunk_bytes': expected int, got str"),
        (_init(endpoint=7), r"field 'endpoint': expected str, got int"),
        (_init(labels={"a": "x"}), r"field \"labels\['a'\]\": expected int"),
    ],
)
def test_parse_init_info_names_the_bad_field(payload: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _engine().parse_init_info(payload)


def test_unknown_field_message_lists_accepted_fields() -> None:
    with pytest.raises(ValueError, match=r"accepted fields: chunk_bytes, endpoint, labels"):
        _engine().parse_init_info(_init(bogus=1))


def test_wire_protocol_missing_where_the_init_info_declares_it() -> None:
    with pytest.raises(ProtocolMismatchError, match=r"missing field 'wire_protocol'") as err:
        _wired().parse_init_info({"endpoint": "e"})
    assert isinstance(err.value, ValueError)
    assert "uses wt-core's shared layout and codec" in str(err.value)
    assert f"wt-core {__version__}" in str(err.value)


def test_an_init_info_without_the_declaration_parses_spec_style_payloads() -> None:
    # a trainer written against the contract alone ships only its own fields
    info = _engine().parse_init_info({"endpoint": "e", "chunk_bytes": 8})
    assert (info.endpoint, info.chunk_bytes) == ("e", 8)
    # a version that arrives anyway is still checked, then dropped
    assert _engine().parse_init_info(_init()).endpoint == "tcp://127.0.0.1:1"
    with pytest.raises(ProtocolMismatchError, match="trainer speaks wire protocol 7"):
        _engine().parse_init_info(_init(wire_protocol=7))


@pytest.mark.parametrize("make", [lambda: _engine(), lambda: _wired()])
def test_wire_protocol_different_version_names_both_and_says_to_align(make: Any) -> None:
    other = WIRE_PROTOCOL_VERSION + 41
    with pytest.raises(ValueError) as err:
        make().parse_init_info(_init(wire_protocol=other))
    msg = str(err.value)
    assert f"trainer speaks wire protocol {other}" in msg
    assert f"this worker speaks {WIRE_PROTOCOL_VERSION}" in msg
    assert "install the same wt-core version" in msg
    assert f"wt-core {__version__}" in msg


def test_wire_protocol_is_checked_before_fields() -> None:
    # a mismatched trainer's unknown fields must not mask the real cause
    with pytest.raises(ProtocolMismatchError):
        _wired().parse_init_info({"wire_protocol": 999, "some_new_field": 1})
    check_wire_protocol({"wire_protocol": WIRE_PROTOCOL_VERSION})


@pytest.mark.parametrize(
    ("payload", "pattern"),
    [
        ({"names": ["a"]}, r"update_info: missing required field 'values' for EchoUpdateInfo"),
        ({"names": ["a"], "values": [1.0], "extra": 1}, r"update_info: unknown field 'extra'"),
        ({"names": "a", "values": [1.0]}, r"field 'names': expected a list, got str"),
        ({"names": ["a", 3], "values": [1.0]}, r"field 'names\[1\]': expected str"),
        ({"names": ["a"], "values": [1.0], "fail": 1}, r"field 'fail': expected bool, got int"),
        ({"names": ["a"], "values": [1.0], "note": 5}, r"field 'note': expected"),
        (["not", "a", "dict"], r"update_info: expected an object, got list"),
    ],
)
def test_parse_update_info_names_the_bad_field(payload: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _engine().parse_update_info(payload)


def test_update_weights_on_cpu_loads_and_does_not_need_an_accelerator() -> None:
    engine = _engine()
    engine.start_weight_update()
    engine.update_weights({"names": ["a", "b"], "values": [1.5, -2.0]})
    engine.finish_weight_update()
    assert engine.calls == ["start", "receive", "finish"]
    assert torch.equal(engine.model.a, torch.full((3,), 1.5))
    assert torch.equal(engine.model.b, torch.full((2, 2), -2.0))
    synchronize_device(torch.device("cpu"))
    synchronize_device(torch.device("meta"))


def test_update_weights_aborts_the_round_on_a_receive_failure() -> None:
    engine = _engine()
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [3.0]})
    with pytest.raises(RuntimeError, match="told to fail"):
        engine.update_weights({"names": ["b"], "values": [9.0], "fail": True})
    assert engine.calls == ["start", "receive", "receive", "abort"]
    # DirectLoader restored what the model served before start
    assert torch.equal(engine.model.a, torch.zeros(3))
    assert torch.equal(engine.model.b, torch.zeros(2, 2))


def test_update_weights_aborts_on_a_parse_failure() -> None:
    engine = _engine()
    engine.start_weight_update()
    with pytest.raises(ValueError, match="missing required field 'names'"):
        engine.update_weights({"values": [1.0]})
    assert engine.calls == ["start", "abort"]


def test_drain_pending_is_idempotent_and_flags_have_defaults() -> None:
    engine = _engine()
    engine.drain_pending()
    engine.drain_pending()
    assert EchoEngine.defers_processing is False
    assert EchoEngine.supports_draft_weight_update is True


def test_set_and_reset_weight_update_target() -> None:
    main_model = TinyModel()
    engine = _connected(EchoEngine(WeightTransferConfig("echo"), None, "cpu", main_model))
    draft, draft_config = TinyModel(), SimpleNamespace(name="draft")
    engine.set_weight_update_target(draft, draft_config)
    assert engine.model is draft and engine.model_config is draft_config
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [7.0]})
    engine.finish_weight_update()
    engine.reset_weight_update_target()
    assert engine.model is main_model and engine.model_config is None
    assert torch.equal(draft.a, torch.full((3,), 7.0))
    assert torch.equal(main_model.a, torch.zeros(3))


def test_request_classes_carry_plain_dicts() -> None:
    assert WeightTransferInitRequest().init_info == {}
    assert WeightTransferUpdateRequest([{"a": 1}]).update_info == [{"a": 1}]


# ---------------------------------------------------------------- positions


def test_worker_position_from_none_position_and_parallel_config() -> None:
    assert worker_position(None) == WorkerPosition(0, 1, 0, 1)
    pos = WorkerPosition(rank=1, world_size=2, data_parallel_index=1, data_parallel_size=3)
    assert worker_position(pos) is pos
    assert (pos.global_index, pos.total_workers) == (3, 6)

    vllm_like = SimpleNamespace(
        parallel_config=SimpleNamespace(
            rank=1, world_size=4, data_parallel_rank=2, data_parallel_size=3
        ),
        model_config=SimpleNamespace(name="m"),
    )
    got = worker_position(vllm_like)
    assert got == WorkerPosition(1, 4, 2, 3)
    assert got.global_index == 9
    # data_parallel_index wins over data_parallel_rank when both exist
    vllm_like.parallel_config.data_parallel_index = 1
    assert worker_position(vllm_like).data_parallel_index == 1

    engine = _engine(vllm_like)
    assert engine.position.global_index == 5
    assert engine.parallel_config is vllm_like.parallel_config
    assert engine.model_config is vllm_like.model_config


def test_worker_position_rejects_other_objects_and_bad_ranks() -> None:
    with pytest.raises(TypeError, match=r"WorkerPosition or None; got str"):
        worker_position("rank0")
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        WorkerPosition(rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_index 1 is outside \[0, 1\)"):
        WorkerPosition(data_parallel_index=1)


# ---------------------------------------------------------------- loading


def test_direct_loader_commit_keeps_and_abort_restores_bit_exactly() -> None:
    model = TinyModel()
    with torch.no_grad():
        model.a.copy_(torch.tensor([0.1, float("nan"), -0.0]))
    before = model.a.detach().clone().view(torch.int32)
    loader = loader_for(model, None)
    assert isinstance(loader, DirectLoader)
    loader.begin()
    loader.load([("a", torch.ones(3))])
    assert torch.equal(model.a, torch.ones(3))
    loader.abort()
    loader.abort()  # idempotent
    assert torch.equal(model.a.detach().view(torch.int32), before)
    loader.begin()
    loader.load([("b", torch.full((2, 2), 4.0))])
    loader.commit()
    loader.abort()  # after commit: nothing to undo
    assert torch.equal(model.b, torch.full((2, 2), 4.0))


def test_loader_provider_is_tried_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from weight_transfer import loading

    monkeypatch.setattr(loading, "_providers", [])
    sentinel = DirectLoader(TinyModel())
    loading.register_loader_provider(lambda model, cfg: sentinel if cfg == "mine" else None)
    assert loader_for(TinyModel(), "mine") is sentinel
    assert loader_for(TinyModel(), None) is not sentinel


# ------------------------------------------------------- the base's transaction


class _Plain(torch.nn.Module):
    """A plain module: parameters, no `load_weights`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 3))
        self.b = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))


def test_direct_loader_copies_into_a_plain_module_by_name() -> None:
    model = _Plain()
    loader = loader_for(model, None)
    loader.begin()
    loader.load([("w", torch.ones(2, 3)), ("b", torch.full((3,), 2.0, dtype=torch.bfloat16))])
    loader.commit()
    assert torch.equal(model.w, torch.ones(2, 3)) and torch.equal(
        model.b.float(), torch.full((3,), 2.0)
    )
    loader.begin()
    with pytest.raises(
        ValueError,
        match=r"'b': received torch.float32 \[3\], the parameter is torch.bfloat16 \[3\]",
    ):
        loader.load([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    with pytest.raises(KeyError, match="no parameter named 'c'"):
        loader.load([("c", torch.zeros(1))])
    loader.abort()
    assert torch.equal(model.w, torch.ones(2, 3))  # the half-applied batch is undone


def test_a_module_that_cannot_be_loaded_is_refused_at_start() -> None:
    engine = _connected(EchoEngine(WeightTransferConfig("echo"), None, "cpu", torch.nn.ReLU()))
    with pytest.raises(TypeError, match=r"ReLU has neither load_weights.*nor parameters"):
        engine.start_weight_update()
    assert not engine.round_open


def test_a_failing_finish_rolls_back_and_closes_the_round() -> None:
    engine = _engine()
    engine.backend.fail_finish = True
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [5.0]})
    with pytest.raises(RuntimeError, match="finish failed"):
        engine.finish_weight_update()
    assert torch.equal(engine.model.a, torch.zeros(3))
    assert not engine.round_open and engine.calls[-1] == "abort"


def test_a_subclass_calling_super_runs_inside_one_transaction() -> None:
    class Layered(EchoEngine):
        def start_weight_update(self) -> None:
            super().start_weight_update()
            self.calls.append("layered-start")

        def finish_weight_update(self) -> None:
            self.calls.append("layered-finish")
            super().finish_weight_update()

    engine = _connected(Layered(WeightTransferConfig("echo"), None, "cpu", TinyModel()))
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [1.0]})
    engine.finish_weight_update()
    assert engine.calls == ["start", "layered-start", "receive", "layered-finish", "finish"]
    assert torch.equal(engine.model.a, torch.ones(3)) and not engine.round_open


def test_a_start_over_an_open_round_rolls_the_old_one_back() -> None:
    # vLLM's worker closes its round when update_weights fails before the engine
    # is called (a per-worker list it cannot index); the engine never heard.
    engine = _engine()
    engine.start_weight_update()
    engine.loader.load([("a", torch.full((3,), 9.0))])
    engine.start_weight_update()
    assert torch.equal(engine.model.a, torch.zeros(3))
    engine.update_weights({"names": ["b"], "values": [2.0]})
    engine.finish_weight_update()
    assert torch.equal(engine.model.a, torch.zeros(3))
    assert torch.equal(engine.model.b, torch.full((2, 2), 2.0))


def test_the_host_ending_a_round_without_finish_rolls_it_back() -> None:
    # vLLM's worker calls reset_weight_update_target after any failed update,
    # also one that failed before the engine was called.
    engine = _engine()
    engine.start_weight_update()
    engine.loader.load([("a", torch.full((3,), 4.0))])
    engine.reset_weight_update_target()
    assert torch.equal(engine.model.a, torch.zeros(3)) and not engine.round_open
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [1.0]})
    engine.finish_weight_update()
    engine.reset_weight_update_target()  # after a finish: nothing to undo
    assert torch.equal(engine.model.a, torch.ones(3))


def test_the_hosts_abort_rolls_the_round_back_and_the_backends_clean_up_runs() -> None:
    """vLLM's newest worker calls `abort_weight_update` on its engine: core's rollback,
    not only the backend's clean-up hook of the same name."""
    engine = _engine()
    engine.abort_weight_update()  # no round: nothing to do
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [3.0]})
    engine.calls.clear()
    engine.abort_weight_update()
    assert not engine.round_open and torch.equal(engine.model.a, torch.zeros(3))
    assert engine.calls == ["abort"]
    engine.start_weight_update()  # the next round works
    engine.update_weights({"names": ["a"], "values": [1.0]})
    engine.finish_weight_update()
    assert torch.equal(engine.model.a, torch.ones(3))


def test_init_is_refused_while_a_round_is_open() -> None:
    engine = _engine()
    engine.init_transfer_engine(engine.parse_init_info(_init()))
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine while a weight update"):
        engine.init_transfer_engine(engine.parse_init_info(_init(endpoint="tcp://other")))
    assert engine.endpoint == "tcp://127.0.0.1:1" and engine.round_open
    engine.finish_weight_update()
    engine.init_transfer_engine(engine.parse_init_info(_init(endpoint="tcp://other")))
    assert engine.endpoint == "tcp://other"


def test_a_stalled_round_is_rolled_back_by_the_engine_itself() -> None:
    engine = _engine()
    engine.round_timeout_s = 0.4
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [6.0]})
    assert torch.equal(engine.model.a, torch.full((3,), 6.0))  # half a round, in place
    deadline = time.monotonic() + 5
    while engine.round_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.round_open and torch.equal(engine.model.a, torch.zeros(3))
    with pytest.raises(RoundAbortedError, match=r"no progress for 0\.4s"):
        engine.finish_weight_update()  # the trainer learns its round is gone
    engine.start_weight_update()
    engine.update_weights({"names": ["b"], "values": [1.0]})
    engine.finish_weight_update()
    assert torch.equal(engine.model.b, torch.ones(2, 2)) and torch.equal(
        engine.model.a, torch.zeros(3)
    )


def test_an_abort_payload_rolls_the_round_back_and_closes_the_hosts_round() -> None:
    session = WorkerSession(_engine())
    engine = session.engine
    session.start_weight_update()
    session.update_weights({"names": ["a"], "values": [2.0]})
    with pytest.raises(RoundAbortedError, match="aborted on request: the trainer failed"):
        session.update_weights({ABORT_FIELD: "the trainer failed"})
    assert not session.active and torch.equal(engine.model.a, torch.zeros(3))


def test_round_client_aborts_a_round_left_open_before_starting_its_own() -> None:
    from weight_transfer.runtime.round_client import RoundClient

    session = WorkerSession(_engine())
    session.start_weight_update()  # a trainer that died here
    session.update_weights({"names": ["a"], "values": [3.0]})
    client = RoundClient(session, timeout_s=10)
    client.start_weight_update()
    assert session.active and torch.equal(session.engine.model.a, torch.zeros(3))
    client.update_weights({"names": ["b"], "values": [5.0]})
    client.finish_weight_update()
    assert torch.equal(session.engine.model.b, torch.full((2, 2), 5.0))


def test_a_round_without_an_undo_record_leaves_the_engine_incomplete_until_one_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No undo copy (`exact_undo` False): a round that fails after loading cannot
    be rolled back, so the engine says so (`Refusal.MODEL_INCOMPLETE`) in this and every
    refusal until a round commits, and refuses to hold a commit."""
    from weight_transfer import loading
    from weight_transfer.base import ModelIncompleteError
    from weight_transfer.runtime.control import HOLD_FIELD, Refusal, refused

    monkeypatch.setattr(loading, "_providers", [])
    loading.register_loader_provider(lambda model, cfg: DirectLoader(model, undo=False))
    engine = _engine()
    engine.start_weight_update()
    with pytest.raises(ValueError, match="missing required field"):  # nothing loaded yet
        engine.update_weights({"values": [1.0]})
    assert engine.incomplete is None
    engine.start_weight_update()
    engine.update_weights({"names": ["a"], "values": [3.0]})
    with pytest.raises(ModelIncompleteError, match="told to fail") as failed:
        engine.update_weights({"names": ["b"], "values": [9.0], "fail": True})
    assert refused(failed.value, Refusal.MODEL_INCOMPLETE) and engine.incomplete is not None
    assert torch.equal(engine.model.a, torch.full((3,), 3.0))  # nothing could undo it
    with pytest.raises(RoundAbortedError) as aborted:  # a trainer's abort hears it too
        engine.update_weights({ABORT_FIELD: "the trainer's round failed"})
    assert refused(aborted.value, Refusal.MODEL_INCOMPLETE)
    engine.start_weight_update()
    with pytest.raises(TypeError, match="cannot revert"):
        engine.update_weights({HOLD_FIELD: True})
    engine.start_weight_update()
    engine.finish_weight_update()  # a round that loads nothing lands nothing
    assert engine.incomplete is not None
    engine.start_weight_update()
    engine.update_weights({"names": ["a", "b"], "values": [5.0, 6.0]})
    engine.finish_weight_update()
    assert engine.incomplete is None
    assert torch.equal(engine.model.b, torch.full((2, 2), 6.0))


def test_an_engine_without_a_channel_refuses_a_round_until_connected_and_after_shutdown() -> None:
    """Core's own connection state, for a backend that keeps no `channel`: the refusal
    carries `Refusal.NO_CONNECTION`, on which a trainer re-admits the workers."""
    from weight_transfer.runtime.control import Refusal, refused

    engine = guarded(EchoEngine(WeightTransferConfig("echo"), None, "cpu", TinyModel()))
    with pytest.raises(RuntimeError) as never:
        engine.start_weight_update()
    assert refused(never.value, Refusal.NO_CONNECTION) and not engine.round_open
    _connected(engine).start_weight_update()
    engine.update_weights({"names": ["a"], "values": [4.0]})
    engine.finish_weight_update()
    assert torch.equal(engine.model.a, torch.full((3,), 4.0))
    engine.shutdown()
    with pytest.raises(RuntimeError) as after:
        engine.start_weight_update()
    assert refused(after.value, Refusal.NO_CONNECTION) and not engine.round_open
