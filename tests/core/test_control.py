"""Who may drive an engine's rounds (`weight_transfer.runtime.control`): the trainer that
connected it, proven per message; everything else is refused naming what is wrong,
and nothing of it is acted on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.core.helpers import EchoEngine, TinyModel
from weight_transfer import WeightTransferConfig, WorkerSession
from weight_transfer.runtime.control import (
    AUTH_FIELD,
    CONTROL_KEY_FIELD,
    HOLD_FIELD,
    REVERT_FIELD,
    SEAL_FIELD,
    ControlKey,
    ControlRefused,
    pop_control_key,
    with_control_key,
)


def _session(key: ControlKey | None) -> WorkerSession:
    engine = EchoEngine(WeightTransferConfig("echo"), None, "cpu", TinyModel())
    session = WorkerSession(engine)
    session.init_weight_transfer_engine(with_control_key({"endpoint": "e"}, key))
    return session


def _update(values: list[float]) -> dict[str, Any]:
    return {"names": ["a"], "values": values}


def _weights(session: WorkerSession) -> torch.Tensor:
    return session.engine.model.a.detach().clone()


def _round(session: WorkerSession, key: ControlKey, values: list[float]) -> None:
    session.start_weight_update()
    session.update_weights(key.sign(_update(values)))
    session.update_weights(key.sign({SEAL_FIELD: True}))
    session.finish_weight_update()


def test_the_trainers_signed_round_lands() -> None:
    key = ControlKey("trainer-1")
    session = _session(key)
    _round(session, key, [2.0])
    assert torch.equal(_weights(session), torch.full((3,), 2.0))


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (lambda key: _update([9.0]), "field 'wt_auth' is missing"),
        (lambda key: {**key.sign(_update([1.0])), "values": [9.0]}, "altered on its way"),
        (lambda key: ControlKey("trainer-1").sign(_update([9.0])), "forged, or altered"),
        (lambda key: ControlKey("intruder").sign(_update([9.0])), "now serves trainer trainer-1"),
        (lambda key: {**_update([9.0]), AUTH_FIELD: {"seq": "1", "mac": "x"}}, "positive int"),
        (lambda key: {**_update([9.0]), AUTH_FIELD: "x"}, "positive int"),
    ],
    ids=["unsigned", "altered", "forged", "another-trainer", "bad-seq", "not-a-dict"],
)
def test_a_message_that_is_not_the_trainers_is_refused_and_changes_nothing(
    message: Any, why: str
) -> None:
    key = ControlKey("trainer-1")
    session = _session(key)
    _round(session, key, [1.0])
    session.start_weight_update()
    with pytest.raises(ControlRefused, match=why):
        session.update_weights(message(key))
    assert torch.equal(_weights(session), torch.ones(3))
    assert not session.active  # the host ended its round: the engine rolled it back
    _round(session, key, [3.0])  # the trainer's next round works
    assert torch.equal(_weights(session), torch.full((3,), 3.0))


def test_a_replayed_or_reordered_message_is_refused() -> None:
    key = ControlKey("trainer-1")
    session = _session(key)
    session.start_weight_update()
    first, second = key.sign(_update([1.0])), key.sign(_update([2.0]))
    session.update_weights(second)
    with pytest.raises(ControlRefused, match="not after the last accepted"):
        session.update_weights(first)  # reordered
    session.start_weight_update()
    with pytest.raises(ControlRefused, match="replayed or reordered"):
        session.update_weights(second)  # replayed


def test_a_finish_only_commits_a_round_the_trainer_sealed() -> None:
    """A finish posted by anyone else is refused and the round stays open for the trainer."""
    key = ControlKey("trainer-1")
    session = _session(key)
    session.start_weight_update()
    session.update_weights(key.sign(_update([5.0])))
    engine = session.engine
    with pytest.raises(ControlRefused, match="before the trainer sealed the round"):
        engine.finish_weight_update()  # what vLLM's route does for any caller
    assert engine.round_open
    session.update_weights(key.sign({SEAL_FIELD: True}))
    session.finish_weight_update()
    assert torch.equal(_weights(session), torch.full((3,), 5.0))


@pytest.mark.parametrize(
    "control",
    [{HOLD_FIELD: "no"}, {HOLD_FIELD: 1}, {SEAL_FIELD: "yes"}, {REVERT_FIELD: 7}],
    ids=["hold-no", "hold-1", "seal-yes", "revert-int"],
)
def test_control_values_are_type_checked(control: dict[str, Any]) -> None:
    key = ControlKey("trainer-1")
    session = _session(key)
    session.start_weight_update()
    with pytest.raises(ValueError, match=f"field '{next(iter(control))}' must be"):
        session.update_weights(key.sign(control))
    assert not session.engine.round_open


def test_a_refused_init_keeps_the_trainer_in_control() -> None:
    key = ControlKey("trainer-1")
    session = _session(key)
    with pytest.raises(ValueError, match=CONTROL_KEY_FIELD):
        session.init_weight_transfer_engine({"endpoint": "e", CONTROL_KEY_FIELD: {"key": "zz"}})
    _round(session, key, [4.0])
    assert torch.equal(_weights(session), torch.full((3,), 4.0))


def test_an_engine_connected_without_a_key_takes_unsigned_messages_as_the_spec_does() -> None:
    session = _session(None)
    session.start_weight_update()
    session.update_weights(_update([6.0]))
    session.finish_weight_update()
    assert torch.equal(_weights(session), torch.full((3,), 6.0))


def test_an_init_without_the_key_is_refused_while_the_trainer_holds_the_engine() -> None:
    """...and it releases nothing: the fleet can still revert the commit it held."""
    key = ControlKey("trainer-1")
    session = _session(key)
    _round(session, key, [1.0])
    session.start_weight_update()
    session.update_weights(key.sign({HOLD_FIELD: True}))
    session.update_weights(key.sign(_update([2.0])))
    session.update_weights(key.sign({SEAL_FIELD: True}))
    session.finish_weight_update()
    assert session.engine.held is not None
    with pytest.raises(ControlRefused, match=f"field '{CONTROL_KEY_FIELD}' is missing"):
        session.init_weight_transfer_engine({"endpoint": "elsewhere"})
    assert session.engine.held is not None and session.engine.endpoint == "e"
    session.start_weight_update()
    session.update_weights(key.sign({REVERT_FIELD: "another replica failed"}))
    session.finish_weight_update()
    assert torch.equal(_weights(session), torch.ones(3))


def test_messages_signed_before_an_engine_connected_are_old_to_it() -> None:
    """A restarted engine gets the key with its last sequence number: nothing recorded
    earlier can be replayed to it."""
    key = ControlKey("trainer-1")
    recorded = key.sign(_update([9.0]))
    session = _session(key)
    session.start_weight_update()
    with pytest.raises(ControlRefused, match="replayed or reordered"):
        session.update_weights(recorded)


def test_a_payload_verifies_the_same_after_json_and_as_python_objects() -> None:
    """HTTP carries JSON (dict keys become strings), Ray carries the objects: both verify."""
    import json

    key = ControlKey("trainer-1")
    _, check = pop_control_key({CONTROL_KEY_FIELD: key.init_field})
    assert check is not None
    body = {"names": ["a"], "offsets": {9: [1], 10: (2, 3)}}
    assert check.verify(key.sign(body))["offsets"] == body["offsets"]  # as Ray: the objects
    assert check.verify(json.loads(json.dumps(key.sign(body))))["names"] == ["a"]  # as HTTP


def test_refusals_are_read_from_codes_and_from_vllms_own_texts() -> None:
    """A client acts on a refusal's code, wherever in the message it sits, and on
    vLLM's host texts, which carry none; other errors carry no refusal."""
    from weight_transfer.runtime.control import Refusal, refusals, refused

    said = Refusal.ABORTED.say("aborted on request: x")
    both = f"RuntimeError: {said}; {Refusal.MODEL_INCOMPLETE.say('part of a round')}"
    assert refusals(RuntimeError(said)) == {Refusal.ABORTED}
    assert refusals(both) == {Refusal.ABORTED, Refusal.MODEL_INCOMPLETE}
    assert refused("worker 0: a weight update is already active", Refusal.ROUND_OPEN)
    assert refused("start_weight_update must be called before update_weights", Refusal.NO_ROUND)
    assert not refused("aborted on request", Refusal.ABORTED)  # the text alone is not a code
    assert refusals("[wt:unknown] x") == set()
    assert not refused(said)  # no code asked for


def test_the_three_round_helpers_act_on_codes_only() -> None:
    """`abort_round` accepts an aborted or already-closed round and refuses an engine
    that took the abort as an update; `start_round` aborts a round left open, once;
    `control_round` treats an accepted refusal as the answer and skips the finish."""
    from weight_transfer.runtime.control import (
        ABORT_FIELD,
        Refusal,
        abort_round,
        control_round,
        start_round,
    )

    calls: list[Any] = []

    def refuse(code: Refusal) -> Any:
        def update(payload: Any) -> None:
            calls.append(payload)
            raise RuntimeError(code.say("no"))

        return update

    abort_round(refuse(Refusal.ABORTED), "r", lambda p: p)
    abort_round(refuse(Refusal.NO_ROUND), "r", lambda p: p)
    assert calls == [{ABORT_FIELD: "r"}, {ABORT_FIELD: "r"}]
    with pytest.raises(RuntimeError, match="not a wt engine"):
        abort_round(calls.append, "r", lambda p: p)
    with pytest.raises(RuntimeError, match="nothing_held"):
        abort_round(refuse(Refusal.NOTHING_HELD), "r", lambda p: p)

    starts: list[int] = []

    def start() -> None:
        starts.append(1)
        if len(starts) == 1:
            raise RuntimeError(Refusal.ROUND_OPEN.say("open"))

    aborted: list[str] = []
    start_round(start, aborted.append)
    assert len(starts) == 2 and len(aborted) == 1
    with pytest.raises(RuntimeError, match="other"):
        start_round(lambda: (_ for _ in ()).throw(RuntimeError("other")), aborted.append)
    assert len(aborted) == 1

    finished: list[int] = []
    control_round(
        lambda: None, refuse(Refusal.NOTHING_HELD), lambda: finished.append(1),
        {"wt_revert": "x"}, lambda p: p, (Refusal.NOTHING_HELD,),
    )  # fmt: skip
    assert finished == []
    control_round(lambda: None, lambda p: None, lambda: finished.append(1), {}, lambda p: p)
    assert finished == [1]
    with pytest.raises(RuntimeError, match="nothing_held"):
        control_round(lambda: None, refuse(Refusal.NOTHING_HELD), lambda: None, {}, lambda p: p)
