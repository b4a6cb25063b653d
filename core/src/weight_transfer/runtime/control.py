"""Who may drive an engine's rounds: the attached trainer, proven per message.

vLLM's weight-transfer routes take whatever a caller posts. So that nobody but
the trainer an engine serves can change, hold, revert or release its weights,
every message a trainer sends inside a round carries proof:

- At init the trainer ships a fresh 256-bit key, its name and the key's last
  sequence number in the init payload (`CONTROL_KEY_FIELD`: `{"key": hex,
  "trainer": trainer_id, "seq": n}`, next to the backend's own fields; core
  removes it before the backend parses the payload). An engine installs the
  key only when its init succeeds, so a refused init leaves the old trainer in
  control, and a restarted engine accepts nothing signed before its init.
- Every update payload and in-band control then carries `AUTH_FIELD`:
  `{"seq": n, "mac": hex, "trainer": trainer_id}`, where `mac` is HMAC-SHA256
  over a domain tag, `seq` (8 bytes) and the payload without `AUTH_FIELD` as
  canonical JSON (sorted keys, no spaces, ASCII). `seq` strictly increases
  over the key's life, so a relay can neither rewrite, replay nor reorder a
  message. (`trainer` only names the claimed sender in refusals; the MAC is
  the proof.) Dict keys are compared as JSON makes them (strings), so a payload
  verifies the same whether it crossed HTTP (JSON) or Ray (pickle).
- A finish commits only a round the trainer sealed (`SEAL_FIELD`, or a
  revert / release control, which load nothing more): a `finish_weight_update`
  posted by anyone else before the trainer's seal is refused, and the round
  stays open for the trainer. The seal carries the label the trainer's finish
  will apply (`VERSION_FIELD`: a string, or null for none); where the host
  hands the engine a finish's label (vLLM, through `weight_transfer.vllm.patches`),
  a finish with another label is refused too.

`ControlKey` is the trainer's side (sign), `ControlCheck` the engine's
(verify). An engine initialized without a key (a trainer written against the
spec alone, a host driving the engine directly) accepts unsigned messages, as
the reference example's engines do; once a key is installed, an unsigned or wrongly signed
message is refused naming what is wrong, and nothing of it is acted on.

The in-band controls are values of reserved fields in an update payload:
`ABORT_FIELD` / `REVERT_FIELD` / `RELEASE_FIELD` carry a reason (a string),
`HOLD_FIELD` and `SEAL_FIELD` the value `true`, `VERSION_FIELD` (beside
`SEAL_FIELD` only) a label or null; anything else is refused
(`check_control_values`).

Refusals are answers too: only an error's message crosses HTTP, Ray and
vLLM's `collective_rpc`, so every refusal a client acts on carries a
`Refusal` code in its message (`[wt:<code>]`, written by `Refusal.say`), and
`refusals(error)` reads them back, in this one place. vLLM's own host refusals
(a start while its round is open, an update without a start) carry no code;
`refusals` knows their texts. The three ways a trainer ends or drives a round
through them are `abort_round`, `start_round` and `control_round`, used by
every client and the fleet.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
import secrets
import threading
from collections.abc import Callable, Collection
from typing import Any

__all__ = [
    "CONTROL_KEY_FIELD",
    "AUTH_FIELD",
    "ABORT_FIELD",
    "HOLD_FIELD",
    "REVERT_FIELD",
    "RELEASE_FIELD",
    "SEAL_FIELD",
    "VERSION_FIELD",
    "ControlKey",
    "ControlCheck",
    "ControlRefused",
    "with_control_key",
    "pop_control_key",
    "check_control_values",
    "Refusal",
    "ChannelDownError",
    "RoundAbortedError",
    "ModelIncompleteError",
    "ForeignEngineError",
    "foreign_engine",
    "refusals",
    "refused",
    "abort_round",
    "start_round",
    "finish_round",
    "control_round",
]

CONTROL_KEY_FIELD = "wt_control_key"
AUTH_FIELD = "wt_auth"
# An update payload `{ABORT_FIELD: reason}` ends the open round on every worker:
# the engine rolls it back and refuses the update (the refusal is what makes
# the host close its round too; the control routes have no abort of their own).
ABORT_FIELD = "wt_abort"
# The fleet's controls (`weight_transfer.fleet`): `{HOLD_FIELD: True}` asks the
# open round to keep its undo record after it commits; in a round of its own,
# `{REVERT_FIELD: reason}` restores the weights that record saved and
# `{RELEASE_FIELD: reason}` drops it (that round loads nothing and finishes).
HOLD_FIELD = "wt_hold"
REVERT_FIELD = "wt_revert"
RELEASE_FIELD = "wt_release"
SEAL_FIELD = "wt_seal"  # {SEAL_FIELD: True}: the trainer has sent everything of this round
VERSION_FIELD = "wt_version"  # beside SEAL_FIELD: the label the trainer's finish applies
MAX_VERSION_CHARS = 256
_DOMAIN = b"wt-control-v1"
_KEY_BYTES = 32
# Reserved fields and the type each value must have (the reasons are strings).
_REASON_FIELDS = (ABORT_FIELD, REVERT_FIELD, RELEASE_FIELD)
_TRUE_FIELDS = (HOLD_FIELD, SEAL_FIELD)


class ControlRefused(RuntimeError):
    """A message that does not prove it comes from the trainer the engine serves."""


def _canonical(body: dict[str, Any]) -> bytes:
    """`body` as JSON would carry it (keys made strings), then sorted and compact;
    `ValueError` when it is not plain JSON."""
    try:
        plain = json.loads(json.dumps(body, allow_nan=False))
        text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"update_info is not plain JSON, so it cannot be signed: {e}") from None
    return text.encode("ascii")


def _mac(key: bytes, seq: int, body: dict[str, Any]) -> str:
    message = _DOMAIN + seq.to_bytes(8, "big") + _canonical(body)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class ControlKey:
    """Trainer `trainer_id`'s key: ships in its init payloads, signs everything it
    sends in a round.

    Thread-safe: a fleet signs controls for several replicas at once; each
    message gets the next sequence number.
    """

    def __init__(self, trainer_id: str = "") -> None:
        self.trainer_id = trainer_id
        self._key = secrets.token_bytes(_KEY_BYTES)
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def init_field(self) -> dict[str, Any]:
        """The value of `CONTROL_KEY_FIELD` in an init payload."""
        with self._lock:
            seq = self._seq
        return {"key": self._key.hex(), "trainer": self.trainer_id, "seq": seq}

    def sign(self, payload: Any) -> Any:
        """`payload` (a dict, or a per-worker list of dicts) with `AUTH_FIELD` added."""
        if isinstance(payload, list):
            return [self.sign(item) for item in payload]
        if not isinstance(payload, dict):
            return payload  # not a payload an engine accepts anyway; it refuses it by type
        body = {k: v for k, v in payload.items() if k != AUTH_FIELD}
        with self._lock:
            self._seq += 1
            seq = self._seq
        auth = {"seq": seq, "mac": _mac(self._key, seq, body), "trainer": self.trainer_id}
        return {**body, AUTH_FIELD: auth}

    def __repr__(self) -> str:
        return "ControlKey(<hidden>)"


def with_control_key(payload: dict[str, Any], key: ControlKey | None) -> dict[str, Any]:
    """An init payload carrying `key` (unchanged without one)."""
    if key is None:
        return payload
    return {**payload, CONTROL_KEY_FIELD: key.init_field}


def pop_control_key(init_dict: dict[str, Any]) -> tuple[dict[str, Any], ControlCheck | None]:
    """`init_dict` without `CONTROL_KEY_FIELD`, and a check of the key it carried
    (None if none). Raises `ValueError` naming the field when it is malformed."""
    if not isinstance(init_dict, dict) or CONTROL_KEY_FIELD not in init_dict:
        return init_dict, None
    rest = {k: v for k, v in init_dict.items() if k != CONTROL_KEY_FIELD}
    value = init_dict[CONTROL_KEY_FIELD]
    fields = value if isinstance(value, dict) else {}
    key_hex, trainer, seq = fields.get("key"), fields.get("trainer", ""), fields.get("seq", 0)
    try:
        key = bytes.fromhex(key_hex) if isinstance(key_hex, str) else b""
    except ValueError:
        key = b""
    well_formed = isinstance(trainer, str) and len(trainer) <= 256
    if len(key) != _KEY_BYTES or not well_formed or type(seq) is not int or not 0 <= seq < 2**63:
        raise ValueError(
            f"init_info: field {CONTROL_KEY_FIELD!r} must be {{'key': {_KEY_BYTES * 2} hex "
            "digits, 'trainer': the trainer's name, 'seq': its last sequence number}"
        )
    return rest, ControlCheck(key, trainer, last_seq=seq)


class ControlCheck:
    """An engine's view of trainer `trainer_id`'s key: `verify` each message before acting.
    `last_seq`: messages numbered up to it are old (sent before this engine connected)."""

    def __init__(self, key: bytes, trainer_id: str = "", *, last_seq: int = 0) -> None:
        self._key = key
        self.trainer_id = trainer_id
        self._last_seq = last_seq

    def same_key(self, other: ControlCheck) -> bool:
        return hmac.compare_digest(self._key, other._key)

    def verify(self, payload: Any) -> dict[str, Any]:
        """`payload` without `AUTH_FIELD`, once its proof checks; `ControlRefused` otherwise.

        The refusal names what is wrong (missing, malformed, replayed, or a
        MAC that does not match: forged or altered on its way); nothing of a
        refused message is acted on, and its sequence number is not consumed.
        """
        if not isinstance(payload, dict):
            raise ControlRefused(
                f"update_info must be a dict, got {type(payload).__name__}; this engine serves "
                "an authenticated trainer"
            )
        auth = payload.get(AUTH_FIELD)
        if auth is None:
            raise ControlRefused(
                f"update_info: field {AUTH_FIELD!r} is missing: this engine takes updates and "
                "controls only from the trainer it serves (a trainer built on wt signs them)"
            )
        seq, mac = (auth.get("seq"), auth.get("mac")) if isinstance(auth, dict) else (None, None)
        if type(seq) is not int or not isinstance(mac, str) or not 0 < seq < 2**63:
            raise ControlRefused(
                f"update_info: field {AUTH_FIELD!r} must be {{'seq': positive int, 'mac': str}}"
            )
        body = {k: v for k, v in payload.items() if k != AUTH_FIELD}
        try:
            expected = _mac(self._key, seq, body)
        except ValueError as e:
            raise ControlRefused(str(e)) from None
        if not hmac.compare_digest(mac, expected):
            sender = auth.get("trainer")
            if isinstance(sender, str) and sender != self.trainer_id:
                raise ControlRefused(
                    f"this message claims to come from trainer {sender or '(unnamed)'}, but "
                    f"the engine now serves trainer {self.trainer_id or '(unnamed)'} (it "
                    "connected since, e.g. with replace_trainer=True); a trainer that lost "
                    "the engine runs trainer_init again (replace_trainer=True takes it back)"
                )
            raise ControlRefused(
                f"update_info: field {AUTH_FIELD!r} does not prove the message comes from the "
                "trainer this engine serves (forged, or altered on its way)"
            )
        if seq <= self._last_seq:
            raise ControlRefused(
                f"update_info: field {AUTH_FIELD!r} carries sequence number {seq}, not after "
                f"the last accepted ({self._last_seq}): a replayed or reordered message"
            )
        self._last_seq = seq
        return body


def check_control_values(payload: dict[str, Any]) -> None:
    """Refuse a reserved control field whose value has the wrong type, naming it."""
    for name in _REASON_FIELDS:
        if name in payload and not isinstance(payload[name], str):
            raise ValueError(
                f"update_info: field {name!r} must be a reason string, got "
                f"{type(payload[name]).__name__}"
            )
    for name in _TRUE_FIELDS:
        if name in payload and payload[name] is not True:
            raise ValueError(f"update_info: field {name!r} must be true, got {payload[name]!r}")
    if VERSION_FIELD in payload:
        version = payload[VERSION_FIELD]
        if SEAL_FIELD not in payload:
            raise ValueError(f"update_info: field {VERSION_FIELD!r} comes only with {SEAL_FIELD!r}")
        if version is not None and (
            not isinstance(version, str) or len(version) > MAX_VERSION_CHARS
        ):
            raise ValueError(
                f"update_info: field {VERSION_FIELD!r} must be a label of at most "
                f"{MAX_VERSION_CHARS} characters or null, got {type(version).__name__}"
            )


# -- refusals ------------------------------------------------------------------
class Refusal(enum.Enum):
    """A refusal a client acts on; its code travels in the error's message."""

    ABORTED = "aborted"  # an in-band abort (`ABORT_FIELD`) rolled the round back
    NOTHING_HELD = "nothing_held"  # a revert found no held commit
    NO_CONNECTION = "no_connection"  # this side has no link to its trainer: re-admit it
    MODEL_INCOMPLETE = "model_incomplete"  # a failed round without undo left part of it
    ROUND_OPEN = "round_open"  # the host's round is still open (a start, an init)
    NO_ROUND = "no_round"  # an update or finish without a started round

    def say(self, message: str) -> str:
        """`message` carrying this code."""
        return f"[wt:{self.value}] {message}"


class ChannelDownError(RuntimeError):
    """A side has no link to its trainer (`Refusal.NO_CONNECTION`); the message
    says why and how to get one."""


class RoundAbortedError(RuntimeError):
    """The open round was rolled back on request (`ABORT_FIELD`) or for lack of progress."""


class ModelIncompleteError(RuntimeError):
    """A round whose transaction keeps no undo record failed after it loaded: the
    model holds part of it. Generation stays paused until a complete round lands;
    the message carries `Refusal.MODEL_INCOMPLETE`, which is how clients across HTTP know."""


_CODE = re.compile(r"\[wt:([a-z_]+)\]")
# vLLM's host refusals, which carry no code (its worker's texts, as of 0.32 / 0.33).
_HOST_TEXTS = {
    "weight update is already active": Refusal.ROUND_OPEN,
    "must be called before update_weights": Refusal.NO_ROUND,
    "without a matching start": Refusal.NO_ROUND,
}
_BY_VALUE = {code.value: code for code in Refusal}


def refusals(error: BaseException | str) -> set[Refusal]:
    """The refusal codes `error`'s message carries (empty for any other error)."""
    text = str(error)
    found = {_BY_VALUE[v] for v in _CODE.findall(text) if v in _BY_VALUE}
    found.update(code for marker, code in _HOST_TEXTS.items() if marker in text)
    return found


def refused(error: BaseException | str, *codes: Refusal) -> bool:
    """Whether `error` is a refusal with one of `codes`."""
    return not refusals(error).isdisjoint(codes)


# vLLM's own engines refuse a wt init info in `parse_init_info`, before any init:
# "Invalid init_info for NCCLWeightTransferEngine: ... unexpected keyword argument ..."
_FOREIGN = re.compile(r"Invalid init_info for (\w+WeightTransferEngine)\b")


def foreign_engine(error: BaseException | str) -> str | None:
    """The class of the non-wt engine whose refusal `error` carries, or None."""
    match = _FOREIGN.search(str(error))
    return match.group(1) if match else None


class ForeignEngineError(RuntimeError):
    """The host runs another weight-transfer engine than wt's (vLLM's own, say):
    nothing was initialized; the message names that engine and the config to use."""


# -- the trainer's three ways through a round -----------------------------------
Sign = Callable[[dict[str, Any]], Any]
Call = Callable[[Any], None]


def abort_round(update: Call, reason: str, sign: Sign) -> None:
    """Roll back the round open on an engine (`ABORT_FIELD` sent through `update`,
    its `update_weights`); a round already closed there is fine. An engine that
    accepts the abort as an update is not a wt engine: `RuntimeError`."""
    try:
        update(sign({ABORT_FIELD: reason}))
    except Exception as error:
        if refused(error, Refusal.ABORTED, Refusal.NO_ROUND):
            return
        raise
    raise RuntimeError("the engine accepted an abort as an update: it is not a wt engine")


def finish_round(finish: Callable[..., None], weight_version: str | None) -> None:
    """`finish(weight_version)`, or `finish()` without a label: a plain client's
    `finish_weight_update` may take no argument."""
    if weight_version is None:
        finish()
    else:
        finish(weight_version)


def start_round(start: Callable[[], None], abort: Callable[[str], None]) -> None:
    """`start()`; a round the host still holds open (a trainer died in it) is
    rolled back first (`abort(reason)`), then started once more."""
    try:
        start()
    except Exception as error:
        if not refused(error, Refusal.ROUND_OPEN):
            raise
        abort("a new round starts while this one was left open")
        start()


def control_round(
    start: Callable[[], None],
    update: Call,
    finish: Callable[[], None],
    payload: dict[str, Any],
    sign: Sign,
    accept: Collection[Refusal] = (),
) -> None:
    """A round that carries one in-band control and loads nothing: start (past a
    round left open), the signed control, finish. A refusal with a code in
    `accept` is an answer too (that refusal closed the round)."""
    start_round(start, lambda reason: abort_round(update, reason, sign))
    try:
        update(sign(payload))
    except Exception as error:
        if refused(error, *accept):
            return
        raise
    finish()
