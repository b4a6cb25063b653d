"""The engine wt's hosts run: a backend's worker engine inside core's round (`GuardedEngine`).

A backend writes a `weight_transfer.base.WeightTransferEngine`: its steps
(`init_transfer_engine`, `start_weight_update`, `receive_weights`,
`finish_weight_update`, `shutdown`, ...). Hosts never run it bare: vLLM
(through wt's plugin), `WorkerSession` and the factory run `GuardedEngine`,
which holds the backend's engine (`backend`), keeps the round's state, and
calls the steps from the methods vLLM's worker calls, top to bottom here:

- `init_transfer_engine`: admits one trainer per engine and installs its
  control key (`weight_transfer.runtime.control`), refused while a round is
  open, then the backend's init;
- `start_weight_update`: rolls back a round left open, checks the connection
  (the backend's `require_connection`), opens the transaction (its
  `new_transaction`), then the backend's start;
- `update_weights`: verifies the MAC, acts on a control (`wt_abort`, `wt_hold`,
  `wt_revert`, `wt_release`, `wt_seal`, `wt_adapter`: the round's transaction
  becomes the host's adapter loader, before anything loaded), else parses and
  loads through the backend's `receive_weights`; any failure aborts the
  transaction;
- `finish_weight_update`: refused until the trainer sealed the round, and,
  where the host hands the engine a finish's label (`finishing_as`), under any
  label but the one the trainer sealed; then the backend's finish and the
  commit (keeping the undo record after a hold);
- a watchdog thread rolls back a round without progress for
  `round_timeout_s` or whose trainer is gone, and reverts a held commit whose
  trainer left before its fleet decided; generation that was paused when the
  round began or while it was open (a client pauses right after its start) is
  resumed through the host (`weight_transfer.runtime.hosts`).

Nothing of the backend's class is rewritten: a backend written as vLLM writes
one (overriding the public methods) runs the same way. Other attributes read on
a `GuardedEngine` are the backend's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from weight_transfer.base import WeightTransferEngine
from weight_transfer.loading import Revertible, Transaction
from weight_transfer.rounds import AlignedFailure
from weight_transfer.runtime import metrics, phases
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
    ChannelDownError,
    ControlCheck,
    ControlRefused,
    ModelIncompleteError,
    Refusal,
    RoundAbortedError,
    check_control_values,
    pop_control_key,
)
from weight_transfer.runtime.devices import synchronize_device
from weight_transfer.runtime.hosts import Generation, host_of
from weight_transfer.runtime.round_client import DEFAULT_TIMEOUT_S

__all__ = ["GuardedEngine", "guarded", "RoundAbortedError", "ModelIncompleteError", "KEY_ATTR"]

logger = logging.getLogger("weight_transfer")

_NO_ROUND = Refusal.NO_ROUND.say("update_weights called without a matching start_weight_update")
KEY_ATTR = "_wt_control_key"  # where a parsed init info keeps the trainer's control key


def _watch_rounds(ref: weakref.ReferenceType[GuardedEngine]) -> None:
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


class GuardedEngine:
    """A backend's worker engine (`backend`) inside core's round; see the module doc.

    Made around an engine (`guarded(engine)`), or, where a host instantiates a
    class as vLLM does, by the class `GuardedEngine.hosting(backend_cls)`,
    whose constructor takes the backend's arguments.
    """

    backend_cls: ClassVar[type[WeightTransferEngine[Any, Any]] | None] = None
    _hosting: ClassVar[dict[type, type[GuardedEngine]]] = {}
    # The round's state, and nothing else: setting any other name is an error
    # (a backend's attribute is set on `backend`).
    __slots__ = (
        "__weakref__",
        "_busy",
        "_committed_as",
        "_control",
        "_expired",
        "_finish_label",
        "_generation",
        "_held_label",
        "_held_paused",
        "_hold",
        "_phase_marks",
        "_progress",
        "_rolled_back",
        "_round_label",
        "_round_loaded",
        "_round_lock",
        "_round_paused",
        "_rounds",
        "_sealed",
        "_sealed_as",
        "_watching",
        "backend",
        "connected",
        "held",
        "incomplete",
        "round_timeout_s",
        "transaction",
    )  # fmt: skip

    def __init__(self, backend: WeightTransferEngine[Any, Any]) -> None:
        self.backend = backend
        backend.round = self
        self.transaction: Transaction | None = None
        self.held: Revertible | None = None  # a committed round kept for revert (HOLD_FIELD)
        self._hold = False  # this round's commit keeps its undo record
        self._rolled_back = 0  # rounds (and held commits) undone: see `_refusals_counted`
        self._phase_marks: tuple[float, float] | None = None  # load, verify seconds at the start
        self.round_timeout_s = DEFAULT_TIMEOUT_S
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
    def hosting(cls, backend_cls: type[WeightTransferEngine[Any, Any]]) -> type[GuardedEngine]:
        """The class a host instantiates for `backend_cls` (one per backend class):
        `(config, vllm_config, device, model)` build the backend's engine."""
        found = cls._hosting.get(backend_cls)
        if found is None:

            def __init__(self: GuardedEngine, *args: Any, **kwargs: Any) -> None:
                GuardedEngine.__init__(self, backend_cls(*args, **kwargs))

            namespace = {"__init__": __init__, "backend_cls": backend_cls, "__slots__": ()}
            found = cls._hosting[backend_cls] = type(backend_cls.__name__, (cls,), namespace)
            found.__qualname__ = f"GuardedEngine.hosting({backend_cls.__qualname__})"
            found.__module__ = backend_cls.__module__
        return found

    def __getattr__(self, name: str) -> Any:
        """Anything not of the round is the backend's (`channel`, its own state)."""
        if name == "backend":  # not set yet (during __init__)
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"<GuardedEngine of {self.backend!r}>"

    # -- what vLLM's worker calls ------------------------------------------
    @property
    def supports_draft_weight_update(self) -> bool:
        return self.backend.supports_draft_weight_update

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """The backend's typed init info; the trainer's control key, taken out of the
        payload first, is kept with it until `init_transfer_engine` installs it."""
        init_dict, key = pop_control_key(init_dict)
        info = self.backend.parse_init_info(init_dict)
        object.__setattr__(info, KEY_ATTR, key)
        return info

    def init_transfer_engine(self, init_info: Any) -> None:
        with self._refusals_counted():
            self._connect(init_info, lambda: self.backend.init_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        with self._refusals_counted():
            self._open_round(self.backend.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        """One update: a control, or the backend's weights; on any failure the round is
        aborted before the error propagates. `{ABORT_FIELD: reason}` rolls the open
        round back and raises `RoundAbortedError`, which closes the host's round too."""
        with self._refusals_counted():
            self._update(update_info)

    def finish_weight_update(self) -> None:
        with self._refusals_counted():
            self._close_round(self.backend.finish_weight_update)

    def abort_weight_update(self) -> None:
        """The host's abort (vLLM's `abort_weight_update`): roll the open round back,
        as an in-band abort does; a no-op without one. Generation stays as it is
        (whoever aborts resumes it). Without this, the backend's clean-up hook of
        the same name would run alone and leave the transaction open."""
        with self._round_lock:
            self._expired = None
            if self.transaction is not None:
                logger.warning("%s: the host aborted the round", type(self.backend).__name__)
                self._abort_round(RoundAbortedError("aborted by the host (abort_weight_update)"))

    def shutdown(self) -> None:
        self.connected = False
        self.backend.shutdown()

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        self.backend.set_weight_update_target(model, model_config)

    def reset_weight_update_target(self) -> None:
        """The host's round is over (vLLM's worker calls it after a finish and after any
        failed start or update, also one that failed before reaching the engine): a
        round still open here is rolled back first; the backend aims at its main
        model again."""
        with self._round_lock:
            self._expired = None  # the host's round is over too
            if self.transaction is not None:
                logger.warning(
                    "%s: the host ended the round without finishing it; rolling it back",
                    type(self.backend).__name__,
                )
                self._abort_round(RuntimeError("the host ended the round"))
        self.backend.reset_weight_update_target()

    @property
    def round_open(self) -> bool:
        return self.transaction is not None

    # -- metrics (`weight_transfer.runtime.metrics`) --------------------------
    @property
    def _label(self) -> str:
        return type(self.backend).__name__

    @contextlib.contextmanager
    def _refusals_counted(self) -> Iterator[None]:
        """A call that fails without undoing anything counts as a refused round."""
        rolled_back = self._rolled_back
        try:
            yield
        except BaseException:
            if self._rolled_back == rolled_back:
                metrics.count_round(self._label, "refused")
            raise

    def _count_round_end(self, outcome: str) -> None:
        """Count the round's outcome and the load and verify seconds it took."""
        metrics.count_round(self._label, outcome)
        marks, self._phase_marks = self._phase_marks, None
        if marks is not None:
            metrics.count_seconds(self._label, "load", phases.total("load") - marks[0])
            metrics.count_seconds(self._label, "verify", phases.total("verify") - marks[1])

    def release_held(self) -> None:
        """Drop the undo record a held commit kept (`HOLD_FIELD`); idempotent."""
        held, self.held = self.held, None
        if held is not None:
            held.release()

    def _require_connection(self) -> None:
        """The backend's `require_connection`; an engine without a channel of its own
        is refused until an init succeeded, and again after `shutdown`."""
        backend = self.backend
        own = type(backend).require_connection is not WeightTransferEngine.require_connection
        if backend.channel is None and not own and not self.connected:
            raise ChannelDownError(
                Refusal.NO_CONNECTION.say(
                    f"{type(backend).__name__}: no trainer is connected (never connected, or "
                    "shut down since): the trainer runs init_weight_transfer_engine again"
                )
            )
        backend.require_connection()

    # -- the round ---------------------------------------------------------
    def _update(self, update_info: Any) -> None:
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
                    type(self.backend).__name__,
                )
                self._abort_round(RuntimeError("superseded by a new start_weight_update"))
            self._require_connection()
            generation = self._find_generation()
            self._round_paused = generation is not None and generation.paused() is True
            self._round_label = (
                generation.label() if generation is not None and self._round_paused else None
            )
            if self.held is not None and not self._round_paused:
                self._held_paused = False  # the fleet resumed: it decided for the new weights
            transaction = self.backend.new_transaction()
            transaction.begin()
            self.transaction = transaction
            self._phase_marks = (phases.total("load"), phases.total("verify"))
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
                self.backend.drain_pending()
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
                self._count_round_end("committed")
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
        host = host_of(self.backend.vllm_config)
        if self._generation is None and host is not None:
            self._generation = host.generation()
        return self._generation

    def _resume_after(self, error: BaseException) -> None:
        """Resume generation after a round failed with `error`; not when the process is
        exiting (`SystemExit`: vLLM's worker on SIGTERM): its engine core is exiting too,
        and asking it to resume would only delay this process's exit by the asks'
        timeouts while the engine core waits for it."""
        if not isinstance(error, SystemExit):
            self._resume_generation(f"the round failed: {error}")

    def _resume_generation(self, why: str) -> None:
        """Resume generation if it was paused when this round began: the trainer that
        paused it may never resume it (it died, stalled, or its round failed here).
        An incomplete model stays paused."""
        paused, self._round_paused = self._round_paused, False
        if paused and self.incomplete is not None:
            logger.warning(
                "%s: generation stays paused (%s; %s)",
                type(self.backend).__name__,
                why,
                self.incomplete,
            )
        elif paused:
            self._resume(why)

    def _resume(self, why: str) -> None:
        """Resume generation; in an engine of several workers, once every one of them
        asked for it in this round (`Generation.resume_when_all`): one worker's resume
        would otherwise run requests while another still rolls back."""
        generation = self._generation
        if generation is not None and generation.paused() is not False:
            logger.warning("%s: resuming generation (%s)", type(self.backend).__name__, why)
            position = self.backend.position
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
        gone = not stalled and self.backend.trainer_alive() is False
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
            logger.warning("%s: %s", type(self.backend).__name__, reason)
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
            if self.backend.trainer_alive() is not False:
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
        started = time.perf_counter()
        try:
            for undo in (
                self.backend.abort_weight_update,
                transaction.abort if transaction else None,
            ):
                if undo is None:
                    continue
                try:
                    undo()
                except BaseException as undo_error:
                    failures.append(undo_error)
        finally:
            self.transaction = None
            if transaction is not None and self._round_loaded:
                self._rolled_back += 1
                metrics.count_seconds(self._label, "rollback", time.perf_counter() - started)
                self._count_round_end("rolled_back")
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
            if keyless and self.backend.trainer_alive() is not False:
                assert holder is not None
                raise ControlRefused(
                    f"init_info: field {CONTROL_KEY_FIELD!r} is missing, but this engine "
                    f"serves trainer {holder.trainer_id or '(unnamed)'}, which signs its "
                    "messages; connect through a wt trainer, or take the engine over "
                    "with replace_trainer=True"
                )
            if check is not None and holder is not None and not takeover:
                self._admit(check, holder)
            self._refuse_unsupported_host()
            subclass_init()
            self.connected = True
            self.release_held()  # a trainer connected: what the last one held is moot
            if check is None or holder is None or not holder.same_key(check):
                self._control = check  # the same key again keeps its sequence numbers
            timeout_s = getattr(init_info, "timeout_s", None)
            if isinstance(timeout_s, (int, float)) and timeout_s > 0:
                self.round_timeout_s = float(timeout_s)

    def _refuse_unsupported_host(self) -> None:
        """`ValueError` when the host says its configuration takes no update
        (`Host.unsupported`: vLLM with EPLB)."""
        host = host_of(self.backend.vllm_config)
        unsupported = getattr(host, "unsupported", None)
        why = unsupported(self.backend.vllm_config) if callable(unsupported) else None
        if why is not None:
            raise ValueError(f"{type(self.backend).__name__}: {why}")

    def _admit(self, check: ControlCheck, holder: ControlCheck) -> None:
        """One trainer per engine: refuse trainer `check` while a different trainer
        (`holder`) is served and known alive (`trainer_alive`); one that died, closed
        its end, or whose liveness this engine cannot tell is replaced."""
        if holder.same_key(check) or check.trainer_id == holder.trainer_id:
            return
        if self.backend.trainer_alive() is not True:
            return
        raise ControlRefused(
            f"{type(self.backend).__name__}: this engine serves trainer "
            f"{holder.trainer_id or '(unnamed)'}, which is alive; trainer "
            f"{check.trainer_id or '(unnamed)'} may take it over only with "
            "replace_trainer=True in its init info"
        )

    # -- payload parsing ---------------------------------------------------

    def _update_locked(self, update_info: Any) -> None:
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
            self._receive(update_info)
            if not self.backend.defers_processing:
                synchronize_device(self.backend.device)
        except AlignedFailure as failed:  # the channel is fine; raise the cause
            self._abort_round(failed.error)
            self._resume_generation(f"the round failed: {failed.error}")
            self._raise_if_incomplete(failed.error)
            raise failed.error from None
        except BaseException as error:
            self._abort_round(error)
            self._resume_after(error)
            self._raise_if_incomplete(error)
            raise

    def _receive(self, update_info: dict[str, Any]) -> None:
        """The backend's receive step: `parse_update_info`, then `receive_weights`; or,
        for a backend that overrides `update_weights` (as a vLLM engine does), that."""
        backend = self.backend
        own = type(backend).update_weights is not WeightTransferEngine.update_weights
        info = None if own else backend.parse_update_info(update_info)
        prepare = getattr(self.transaction, "prepare", None)
        self._round_loaded = True  # from here the model may change
        if callable(prepare):
            prepare()
        started = time.perf_counter()
        try:
            if own:
                backend.update_weights(update_info)
            else:
                backend.receive_weights(info)
        finally:
            metrics.count_seconds(self._label, "wire", time.perf_counter() - started)
        nbytes = getattr(info, "nbytes", None)
        if isinstance(nbytes, int):
            metrics.count_bytes(self._label, nbytes)

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
                    f"{type(self.backend).__name__}: asked to revert ({reason}), but no committed "
                    "round is held (none was asked to hold, or a later round loaded since)"
                )
            )
        logger.warning(
            "%s: reverting the last committed round (%s)", type(self.backend).__name__, reason
        )
        started = time.perf_counter()
        held.revert()
        self._rolled_back += 1
        metrics.count_seconds(self._label, "rollback", time.perf_counter() - started)
        metrics.count_round(self._label, "rolled_back")

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
            self._resume_after(error)
            raise

    def _adapter_loader(self, adapter: Adapter) -> Transaction:
        """The host's loader for a round that updates `adapter` (vLLM: its LoRA slots)."""
        backend = self.backend
        make = getattr(host_of(backend.vllm_config), "adapter_loader", None)
        if not backend.supports_adapter_update or not callable(make):
            who = type(backend).__name__ if not backend.supports_adapter_update else "this host"
            raise TypeError(f"{who} cannot take a LoRA adapter round ({adapter.name!r})")
        return make(backend.model, backend.vllm_config, adapter)

    def _hold_commit(self) -> None:
        """`HOLD_FIELD`: this round's commit keeps its undo record, or the hold is refused."""
        transaction = self.transaction
        if transaction is None:
            raise RuntimeError(_NO_ROUND)
        if not isinstance(transaction, Revertible) or not getattr(transaction, "exact_undo", True):
            error = TypeError(
                f"{type(self.backend).__name__}: the round's transaction "
                f"({type(transaction).__name__}) cannot revert a committed round, so this "
                "engine cannot hold a commit for an all-or-nothing fleet round"
            )
            self._abort_round(error)
            raise error
        self._hold = True


def guarded(engine: WeightTransferEngine[Any, Any] | GuardedEngine) -> GuardedEngine:
    """`engine` inside core's round (itself when it is one already)."""
    return engine if isinstance(engine, GuardedEngine) else GuardedEngine(engine)
