"""The worker's round, which every `WeightTransferEngine` runs on (`WorkerRound`).

A backend never calls into this module: `weight_transfer.base` states the
contract (what the round guarantees and which hooks a backend writes), and
this module keeps it. `WeightTransferEngine` inherits `WorkerRound` and wraps
each subclass's `init_transfer_engine`, `start_weight_update`,
`finish_weight_update` and `shutdown` (`round_step`) and `parse_init_info`
(`keyed_parse`) as the subclass is defined, so that:

- init admits one trainer per engine and installs its control key
  (`weight_transfer.runtime.control`), refused while a round is open;
- start rolls back a round left open, checks the connection
  (`require_connection`), opens the transaction (`new_transaction`), then
  runs the subclass's start;
- an update verifies its MAC, acts on a control (`wt_abort`, `wt_hold`,
  `wt_revert`, `wt_release`, `wt_seal`, `wt_adapter`: the round's
  transaction becomes the host's adapter loader, before anything loaded),
  else loads through `receive_weights`; any failure aborts the transaction;
- finish is refused until the trainer sealed the round, and, where the host
  hands the engine a finish's label (`finishing_as`), under any label but the
  one the trainer sealed; then it commits (keeping the undo record after a
  hold);
- a watchdog thread rolls back a round without progress for
  `round_timeout_s` or whose trainer is gone, and reverts a held commit whose
  trainer left before its fleet decided; generation that was paused when the
  round began or while it was open (a client pauses right after its start) is
  resumed through the host (`weight_transfer.runtime.hosts`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weight_transfer.loading import Revertible, Transaction
from weight_transfer.position import WorkerPosition
from weight_transfer.rounds import AlignedFailure
from weight_transfer.runtime.adapters import ADAPTER_FIELD, Adapter
from weight_transfer.runtime.control import (
    ABORT_FIELD,
    AUTH_FIELD,
    CONTROL_KEY_FIELD,
    HOLD_FIELD,
    RELEASE_FIELD,
    REVERT_FIELD,
    SEAL_FIELD,
    VERSION_FIELD,
    ControlCheck,
    ControlRefused,
    Refusal,
    check_control_values,
    pop_control_key,
)
from weight_transfer.runtime.devices import synchronize_device
from weight_transfer.runtime.hosts import Generation, host_of
from weight_transfer.runtime.round_client import DEFAULT_TIMEOUT_S

__all__ = [
    "WorkerRound",
    "RoundAbortedError",
    "ModelIncompleteError",
    "ROUND_STEPS",
    "KEY_ATTR",
    "round_step",
    "keyed_parse",
]

logger = logging.getLogger("weight_transfer")

ROUND_STEPS = ("init_transfer_engine", "start_weight_update", "finish_weight_update", "shutdown")
_NO_ROUND = Refusal.NO_ROUND.say("update_weights called without a matching start_weight_update")
KEY_ATTR = "_wt_control_key"  # where a parsed init info keeps the trainer's control key


class RoundAbortedError(RuntimeError):
    """The open round was rolled back on request (`ABORT_FIELD`) or for lack of progress."""


class ModelIncompleteError(RuntimeError):
    """A round whose transaction keeps no undo record failed after it loaded: the
    model holds part of it. Generation stays paused until a complete round lands;
    the message carries `Refusal.MODEL_INCOMPLETE`, which is how clients across HTTP know."""


def _watch_rounds(ref: weakref.ReferenceType[WorkerRound]) -> None:
    """Daemon loop: roll back an engine's round that stalls (ends with the engine)."""
    while True:
        engine = ref()
        if engine is None:
            return
        try:
            engine._watch()
        except Exception:  # the watchdog must outlive any one failure
            logger.exception("%s: the round watchdog's check failed", type(engine).__name__)
        period = min(1.0, engine.round_timeout_s / 4)
        del engine
        time.sleep(period)


def round_step(name: str, step: Callable[..., None]) -> Callable[..., None]:
    """Run a subclass's `start_weight_update` / `finish_weight_update` (`name`)
    inside the base class's transaction (see `WeightTransferEngine`); refuse its
    `init_transfer_engine` while a round is open."""

    @functools.wraps(step)
    def wrapper(self: Any, *args: Any) -> None:
        if self._in_round_step:  # a subclass calling super(): the outer wrapper owns it
            step(self, *args)
            return
        self._in_round_step = True
        try:
            if name == "init_transfer_engine":
                self._connect(args[0] if args else None, lambda: step(self, *args))
            elif name == "shutdown":
                self.connected = False
                step(self)
            elif name == "start_weight_update":
                self._open_round(lambda: step(self))
            else:
                self._close_round(lambda: step(self))
        finally:
            self._in_round_step = False

    wrapper.__wt_round_step__ = True  # type: ignore[attr-defined]
    return wrapper


def keyed_parse(parse: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's own `parse_init_info`, given the payload without the trainer's
    control key, which is kept with the parsed info (see `parse_init_info`)."""

    @functools.wraps(parse)
    def wrapper(self: Any, init_dict: dict[str, Any]) -> Any:
        init_dict, key = pop_control_key(init_dict)
        info = parse(self, init_dict)
        object.__setattr__(info, KEY_ATTR, key)
        return info

    wrapper.__wt_keyed__ = True  # type: ignore[attr-defined]
    return wrapper


class WorkerRound:
    """The round's state and steps on one worker engine (see the module doc).

    `WeightTransferEngine` is its only subclass here; it declares the hooks
    this class calls (`require_connection`, `new_transaction`,
    `parse_update_info`, `receive_weights`, `abort_weight_update`,
    `drain_pending`, `release_held`, `trainer_alive`).
    """

    if TYPE_CHECKING:  # declared by `WeightTransferEngine`
        position: WorkerPosition
        vllm_config: Any
        device: torch.device
        defers_processing: ClassVar[bool]
        supports_adapter_update: ClassVar[bool]
        model: torch.nn.Module

        def require_connection(self) -> None: ...
        def new_transaction(self) -> Transaction: ...
        def parse_update_info(self, update_dict: dict[str, Any]) -> Any: ...
        def receive_weights(self, update_info: Any) -> None: ...
        def abort_weight_update(self) -> None: ...
        def drain_pending(self) -> None: ...
        def release_held(self) -> None: ...
        def trainer_alive(self) -> bool | None: ...

    def __init__(self) -> None:
        self.transaction: Transaction | None = None
        self.held: Revertible | None = None  # a committed round kept for revert (HOLD_FIELD)
        self._hold = False  # this round's commit keeps its undo record
        self.round_timeout_s = DEFAULT_TIMEOUT_S
        self._in_round_step = False
        self._round_lock = threading.RLock()
        self._busy = False
        self._progress = time.monotonic()
        self._expired: str | None = None
        self._watching = False
        self._control: ControlCheck | None = None  # the served trainer's key (`control`)
        self.connected = False  # an init succeeded since the last shutdown
        self._generation: Generation | None = None  # the host's, found on a control call
        self._rounds = 0  # rounds opened: the same count on every worker of an engine
        self._round_paused = False  # generation was paused in this round (at start or since)
        self._round_label: str | None = None  # ... under this weight version label
        self._held_paused = False  # ... and has stayed paused since the held commit
        self._held_label: str | None = None  # the label before the held round
        self._sealed = False  # the trainer said this round is complete (`SEAL_FIELD`)
        self._sealed_as: tuple[str | None] | None = None  # ... and the label it finishes with
        self._finish_label: tuple[str | None] | None = None  # the finish's, from the host
        self._committed_as: tuple[str | None] | None = None  # the last sealed round committed
        self._round_loaded = False  # this round's transaction may have changed the model
        self.incomplete: str | None = None  # why the model holds a failed round's part

    @classmethod
    def wrap_round_steps(cls) -> None:
        """Wrap the round steps and `parse_init_info` that `cls` itself defines."""
        for name in ROUND_STEPS:
            step = cls.__dict__.get(name)
            if callable(step) and not getattr(step, "__wt_round_step__", False):
                setattr(cls, name, round_step(name, step))
        parse = cls.__dict__.get("parse_init_info")
        if callable(parse) and not getattr(parse, "__wt_keyed__", False):
            cls.parse_init_info = keyed_parse(parse)  # type: ignore[attr-defined]

    def _update(self, update_info: dict[str, Any]) -> None:
        """`update_weights` under the round's lock, with its progress recorded."""
        with self._round_lock:
            self._busy = True
            try:
                self._update_locked(update_info)
            finally:
                self._busy = False
                self._progress = time.monotonic()

    def _open_round(self, subclass_start: Callable[[], None]) -> None:
        with self._round_lock:
            self._rounds += 1
            self._expired = None
            self._progress = time.monotonic()
            if not self._watching:
                self._watching = True
                threading.Thread(
                    target=_watch_rounds, args=(weakref.ref(self),), name="wt-round-watch",
                    daemon=True,
                ).start()  # fmt: skip
            if self.transaction is not None:
                # Hosts refuse a start while their round is open, so the host closed
                # this one after a failure the engine never saw: roll it back first.
                logger.warning(
                    "%s: a new round starts while the previous one is still open; "
                    "rolling the previous one back",
                    type(self).__name__,
                )
                self._abort_round(RuntimeError("superseded by a new start_weight_update"))
            self.require_connection()
            generation = self._find_generation()
            self._round_paused = generation is not None and generation.paused() is True
            self._round_label = (
                generation.label() if generation is not None and self._round_paused else None
            )
            if self.held is not None and not self._round_paused:
                self._held_paused = False  # the fleet resumed: it decided for the new weights
            transaction = self.new_transaction()
            transaction.begin()
            self.transaction = transaction
            self._hold = False
            self._sealed = False
            self._sealed_as = self._committed_as = None
            self._round_loaded = False
            try:
                subclass_start()
            except BaseException as error:
                self._abort_round(error)
                raise

    def _close_round(self, subclass_finish: Callable[[], None]) -> None:
        with self._round_lock:
            if self._expired is not None:
                expired, self._expired = self._expired, None
                raise RoundAbortedError(expired)
            transaction = self.transaction
            if transaction is not None and self._control is not None:
                self._check_finisher()
            try:
                self.drain_pending()
                subclass_finish()
                if transaction is None:
                    pass
                elif self._hold and isinstance(transaction, Revertible):
                    self.release_held()  # an older record, had its release not arrived
                    transaction.commit(keep_undo=True)
                    self.held = transaction
                    self._held_paused = self._round_paused
                    self._held_label = self._round_label
                else:
                    transaction.commit()
            except BaseException as error:
                self._abort_round(error)
                self._raise_if_incomplete(error)
                raise
            self.transaction = None
            self._hold = False
            if self._round_loaded:
                self.incomplete = None  # a round that loaded has landed
            self._round_loaded = False
            if self._control is not None and self._sealed_as is not None:
                self._committed_as = self._sealed_as

    def _check_finisher(self) -> None:
        """Only the trainer this engine serves finishes its round: refuse a finish
        before its seal, or with a label other than the one it sealed (the round
        stays open for the trainer's own finish)."""
        if not self._sealed:
            raise ControlRefused(
                "finish_weight_update before the trainer sealed the round: only the "
                "trainer this engine serves may finish it (the round stays open for it)"
            )
        claimed, sealed = self._finish_label, self._sealed_as
        if claimed is not None and sealed is not None and claimed != sealed:
            raise ControlRefused(
                f"finish_weight_update with weight_version {claimed[0]!r}, but the trainer "
                f"sealed this round to finish as {sealed[0]!r}: only its own finish may "
                "commit it (the round stays open for it)"
            )

    @contextlib.contextmanager
    def finishing_as(self, weight_version: str | None) -> Iterator[bool]:
        """The host's finish of this round will set label `weight_version` (vLLM's
        `finish_weight_update(weight_version)`, through `weight_transfer.vllm.patches`):
        the finish inside the block is checked against the trainer's seal. Yields
        whether the last round this engine committed is the trainer's, sealed
        with this very label, and no round opened or such finish came since: then
        another caller's finish committed what the trainer's finish would have."""
        with self._round_lock:
            self._finish_label = (weight_version,)
            committed = self.transaction is None and self._committed_as == (weight_version,)
            if committed:
                self._committed_as = None  # once: a later finish is answered as the host's
            try:
                yield committed
            finally:
                self._finish_label = None

    def _find_generation(self) -> Generation | None:
        """The host's generation running this worker (`hosts.Host.generation`, asked on a
        control call)."""
        host = host_of(self.vllm_config)
        if self._generation is None and host is not None:
            self._generation = host.generation()
        return self._generation

    def _resume_generation(self, why: str) -> None:
        """Resume generation if it was paused when this round began: the trainer that
        paused it may never resume it (it died, stalled, or its round failed here).
        An incomplete model stays paused."""
        paused, self._round_paused = self._round_paused, False
        if paused and self.incomplete is not None:
            logger.warning(
                "%s: generation stays paused (%s; %s)", type(self).__name__, why, self.incomplete
            )
        elif paused:
            self._resume(why)

    def _resume(self, why: str) -> None:
        """Resume generation; in an engine of several workers, once every one of them
        asked for it in this round (`Generation.resume_when_all`): one worker's resume
        would otherwise run requests while another still rolls back."""
        generation = self._generation
        if generation is not None and generation.paused() is not False:
            logger.warning("%s: resuming generation (%s)", type(self).__name__, why)
            position = self.position
            generation.resume_when_all(self._rounds, position.rank, position.world_size)

    def _watch(self) -> None:
        """The watchdog's tick: end a round, or a held commit, that lost its trainer."""
        self._expire_stale_round()
        if self.transaction is None and self.held is not None:
            self._revert_orphaned_hold()

    def _expire_stale_round(self) -> None:
        """Roll back a round with no call in progress for `round_timeout_s`, or whose
        trainer is gone (`trainer_alive()` is False), and resume generation if it
        was paused for the round; its next update or finish says so."""
        if self.transaction is None or self._busy:
            return
        stalled = time.monotonic() - self._progress >= self.round_timeout_s
        gone = not stalled and self.trainer_alive() is False
        if not (stalled or gone) or not self._round_lock.acquire(blocking=False):
            return
        try:
            if self.transaction is None or self._busy:
                return
            if stalled:
                reason = (
                    f"the round made no progress for {self.round_timeout_s:g}s (no update or "
                    "finish arrived) and was rolled back; start a new one"
                )
            else:
                reason = "the trainer left during the round (it died, or closed its end)"
            logger.warning("%s: %s", type(self).__name__, reason)
            self._note_pause()
            try:
                self._abort_round(RoundAbortedError(reason))
            finally:
                self._expired = reason if self.incomplete is None else self.incomplete
                if self.held is not None and self._held_paused and self._round_paused:
                    self._revert_held_orphan(reason)  # a fleet's revert round, never run
                self._resume_generation(reason)
        finally:
            self._round_lock.release()

    def _revert_orphaned_hold(self) -> None:
        """A fleet keeps generation paused on a held commit until it knows every
        replica finished. A trainer that dies first never decides: revert (the
        fleet did not confirm the new weights) and resume. Once generation has
        resumed, the fleet had decided for the new weights: keep them."""
        generation = self._generation
        if generation is None or not self._held_paused:
            return
        paused = generation.paused()
        if paused is None:  # cannot tell: decide nothing
            return
        if not self._round_lock.acquire(blocking=False):
            return
        try:
            if self.transaction is not None or self.held is None:
                return
            if not paused:
                self._held_paused = False
                return
            if self.trainer_alive() is not False:
                return
            reason = "the trainer left before its fleet confirmed the held round"
            self._revert_held_orphan(reason)
            self._resume(reason)
        finally:
            self._round_lock.release()

    def _revert_held_orphan(self, reason: str) -> None:
        """Revert the held commit a fleet never confirmed and give its label back."""
        self._held_paused = False
        self._revert_held(reason)
        if self._held_label is not None and self._generation is not None:
            self._generation.set_label(self._held_label)  # its finish set the new one

    def _abort_round(self, error: BaseException) -> None:
        """The subclass's `abort_weight_update`, then the transaction's abort; both always run.

        The round stays open (`round_open`) until both have run, so nobody sees
        a closed round on a model that is still being restored.
        """
        transaction = self.transaction
        failures: list[BaseException] = []
        try:
            for undo in (self.abort_weight_update, transaction.abort if transaction else None):
                if undo is None:
                    continue
                try:
                    undo()
                except BaseException as undo_error:
                    failures.append(undo_error)
        finally:
            self.transaction = None
            if self._round_loaded and not getattr(transaction, "exact_undo", True):
                self.incomplete = Refusal.MODEL_INCOMPLETE.say(
                    f"the model is incomplete: a round without an undo record "
                    f"({type(transaction).__name__}) failed after it loaded "
                    f"({type(error).__name__}: {error}); generation stays paused until a "
                    "complete round lands"
                )
            self._round_loaded = False
        if failures:
            first = failures[0]
            raise RuntimeError(
                f"the weight update failed ({type(error).__name__}: {error}) and rolling "
                f"back failed too ({type(first).__name__}: {first})"
            ) from error

    def _raise_if_incomplete(self, error: BaseException) -> None:
        """Raise `ModelIncompleteError` for `error` when the model is incomplete."""
        if self.incomplete is not None:
            raise ModelIncompleteError(self.incomplete) from error

    def _connect(self, init_info: Any, subclass_init: Callable[[], None]) -> None:
        """The subclass's init, then its trainer's control key; refused while a round is
        open, and without a key while a live keyed trainer holds the engine."""
        with self._round_lock:
            if self.transaction is not None:
                raise RuntimeError(
                    Refusal.ROUND_OPEN.say(
                        "init_weight_transfer_engine while a weight update is active: finish "
                        "the round (or let it fail) before connecting a trainer"
                    )
                )
            check: ControlCheck | None = getattr(init_info, KEY_ATTR, None)
            holder = self._control
            takeover = bool(getattr(init_info, "replace", False))
            keyless = check is None and holder is not None and not takeover
            if keyless and self.trainer_alive() is not False:
                assert holder is not None
                raise ControlRefused(
                    f"init_info: field {CONTROL_KEY_FIELD!r} is missing, but this engine "
                    f"serves trainer {holder.trainer_id or '(unnamed)'}, which signs its "
                    "messages; connect through a wt trainer, or take the engine over "
                    "with replace_trainer=True"
                )
            if check is not None and holder is not None and not takeover:
                self._admit(check, holder)
            subclass_init()
            self.connected = True
            self.release_held()  # a trainer connected: what the last one held is moot
            if check is None or holder is None or not holder.same_key(check):
                self._control = check  # the same key again keeps its sequence numbers
            timeout_s = getattr(init_info, "timeout_s", None)
            if isinstance(timeout_s, (int, float)) and timeout_s > 0:
                self.round_timeout_s = float(timeout_s)

    def _admit(self, check: ControlCheck, holder: ControlCheck) -> None:
        """One trainer per engine: refuse trainer `check` while a different trainer
        (`holder`) is served and known alive (`trainer_alive`); one that died, closed
        its end, or whose liveness this engine cannot tell is replaced."""
        if holder.same_key(check) or check.trainer_id == holder.trainer_id:
            return
        if self.trainer_alive() is not True:
            return
        raise ControlRefused(
            f"{type(self).__name__}: this engine serves trainer "
            f"{holder.trainer_id or '(unnamed)'}, which is alive; trainer "
            f"{check.trainer_id or '(unnamed)'} may take it over only with "
            "replace_trainer=True in its init info"
        )

    # -- payload parsing ---------------------------------------------------

    def _update_locked(self, update_info: dict[str, Any]) -> None:
        if self._control is not None:
            update_info = self._control.verify(update_info)
        elif isinstance(update_info, dict) and AUTH_FIELD in update_info:
            update_info = {k: v for k, v in update_info.items() if k != AUTH_FIELD}  # no key
        if isinstance(update_info, dict):
            check_control_values(update_info)
            if ABORT_FIELD in update_info:
                self._abort_on_request(str(update_info[ABORT_FIELD]))
            if REVERT_FIELD in update_info:
                self._sealed = True  # a control round loads nothing more
                self._revert_held(str(update_info[REVERT_FIELD]))
                return
            if RELEASE_FIELD in update_info:
                self._sealed = True
                self.release_held()
                return
        if self._expired is not None:
            expired, self._expired = self._expired, None
            raise RoundAbortedError(expired)
        if isinstance(update_info, dict) and HOLD_FIELD in update_info:
            self._hold_commit()
            return
        if isinstance(update_info, dict) and ADAPTER_FIELD in update_info:
            self._target_adapter(update_info[ADAPTER_FIELD])
            return
        if isinstance(update_info, dict) and SEAL_FIELD in update_info:
            if self.transaction is None:
                raise RuntimeError(_NO_ROUND)
            self._sealed = True
            if VERSION_FIELD in update_info:
                self._sealed_as = (update_info[VERSION_FIELD],)
            return
        if self.transaction is None:
            raise RuntimeError(_NO_ROUND)
        self.release_held()  # this round's loads reuse the buffers it holds
        try:
            self._check_still_paused()
            info = self.parse_update_info(update_info)
            prepare = getattr(self.transaction, "prepare", None)
            self._round_loaded = True
            if callable(prepare):
                prepare()
            self.receive_weights(info)
            if not self.defers_processing:
                synchronize_device(self.device)
        except AlignedFailure as failed:  # the channel is fine; raise the cause
            self._abort_round(failed.error)
            self._resume_generation(f"the round failed: {failed.error}")
            self._raise_if_incomplete(failed.error)
            raise failed.error from None
        except BaseException as error:
            self._abort_round(error)
            self._resume_generation(f"the round failed: {error}")
            self._raise_if_incomplete(error)
            raise

    def _note_pause(self) -> bool | None:
        """Generation's pause state now (None: unknown); a pause that began while this
        round was open belongs to it (wt's clients pause right after their start),
        so the round resumes it if it fails without its trainer."""
        generation = self._generation
        paused = generation.paused() if generation is not None else None
        if paused is True and not self._round_paused:
            assert generation is not None
            self._round_paused = True
            self._round_label = generation.label()
        return paused

    def _check_still_paused(self) -> None:
        """Refuse to load while requests run: generation was paused in this round and
        has been resumed since (by a caller of the server's own routes, say)."""
        was_paused = self._round_paused
        if self._note_pause() is False and was_paused:
            self._round_paused = False
            raise RuntimeError(
                "generation was resumed while this round was open: loading now would run "
                "requests on a half-loaded model, so the round is rolled back"
            )

    def _abort_on_request(self, reason: str) -> None:
        """`ABORT_FIELD`: roll the open round back and raise `RoundAbortedError`
        (the refusal is what makes the host close its round too)."""
        message = Refusal.ABORTED.say(f"aborted on request: {reason}")
        self._expired = None
        if self.transaction is not None:
            self._abort_round(RoundAbortedError(message))
        if self.incomplete is not None:
            message = f"{message}; {self.incomplete}"
        raise RoundAbortedError(message)

    def _revert_held(self, reason: str) -> None:
        """`REVERT_FIELD`: the model serves what it served before the held round."""
        held, self.held = self.held, None
        if held is None:
            raise RuntimeError(
                Refusal.NOTHING_HELD.say(
                    f"{type(self).__name__}: asked to revert ({reason}), but no committed "
                    "round is held (none was asked to hold, or a later round loaded since)"
                )
            )
        logger.warning("%s: reverting the last committed round (%s)", type(self).__name__, reason)
        held.revert()

    def _target_adapter(self, payload: Any) -> None:
        """`ADAPTER_FIELD`: the open round updates that LoRA adapter, not the model.
        Its transaction, which has not loaded yet, is replaced by the adapter loader."""
        transaction = self.transaction
        if transaction is None:
            raise RuntimeError(_NO_ROUND)
        try:
            if self._round_loaded:
                raise RuntimeError(
                    f"update_info: field {ADAPTER_FIELD!r} must come before the round's "
                    "first load (this round has loaded model weights already)"
                )
            loader = self._adapter_loader(Adapter.from_payload(payload))
            self.transaction = None
            transaction.abort()  # it never loaded: nothing changes
            loader.begin()
            self.transaction = loader
        except BaseException as error:
            self.transaction = self.transaction or transaction
            self._abort_round(error)
            self._resume_generation(f"the round failed: {error}")
            raise

    def _adapter_loader(self, adapter: Adapter) -> Transaction:
        """The host's loader for a round that updates `adapter` (vLLM: its LoRA slots)."""
        make = getattr(host_of(self.vllm_config), "adapter_loader", None)
        if not self.supports_adapter_update or not callable(make):
            who = type(self).__name__ if not self.supports_adapter_update else "this host"
            raise TypeError(f"{who} cannot take a LoRA adapter round ({adapter.name!r})")
        return make(self.model, self.vllm_config, adapter)

    def _hold_commit(self) -> None:
        """`HOLD_FIELD`: this round's commit keeps its undo record, or the hold is refused."""
        transaction = self.transaction
        if transaction is None:
            raise RuntimeError(_NO_ROUND)
        if not isinstance(transaction, Revertible) or not getattr(transaction, "exact_undo", True):
            error = TypeError(
                f"{type(self).__name__}: the round's transaction ({type(transaction).__name__}) "
                "cannot revert a committed round, so this engine cannot hold a commit for an "
                "all-or-nothing fleet round"
            )
            self._abort_round(error)
            raise error
        self._hold = True
