"""The four abstractions and their payload types.

Trainer side: `WeightSource` (what to send, see `weight_transfer.source`),
`VLLMWeightSyncClient` (how to reach the inference engine),
`TrainerWeightTransferEngine` (how to transmit), configured by a
`TrainerInitInfo` subclass whose `backend` ClassVar selects the engine.

Inference side: `WeightTransferEngine` (how to receive and load), configured by
`WeightTransferInitInfo` (once, from the trainer's handshake) and
`WeightTransferUpdateInfo` (per round).

The four control-plane calls, in order: `init_weight_transfer_engine` once,
then per round `start_weight_update`, one or more `update_weights`,
`finish_weight_update`. Anything both sides must agree on travels in the init
info, never in per-round update info.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from weight_transfer.control import (
    ABORT_FIELD,
    AUTH_FIELD,
    CONTROL_KEY_FIELD,
    HOLD_FIELD,
    RELEASE_FIELD,
    REVERT_FIELD,
    SEAL_FIELD,
    ChannelDownError,
    ControlCheck,
    ControlRefused,
    Refusal,
    check_control_values,
    pop_control_key,
    refused,
)
from weight_transfer.hooks import SyncTracker
from weight_transfer.loading import (
    Revertible,
    Transaction,
    WeightLoader,
    is_vllm_config,
    loader_for,
)
from weight_transfer.payload import parse_payload
from weight_transfer.position import WorkerPosition, worker_position
from weight_transfer.rounds import (
    DEFAULT_TIMEOUT_S,
    AlignedFailure,
    RoundClient,
    TrainerRound,
    new_trainer_id,
)
from weight_transfer.source import WeightSource  # in the engine's signatures, as in the spec
from weight_transfer.wire import WireProtocolInfo, check_wire_protocol

__all__ = [
    "WeightSource",
    "UpdatePayload",
    "ABORT_FIELD",
    "RoundAbortedError",
    "ModelIncompleteError",
    "VLLMWeightSyncClient",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "WeightTransferConfig",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
    "WeightTransferEngine",
    "synchronize_device",
    "trainer_device",
]

UpdatePayload = dict[str, Any] | list[dict[str, Any]]

logger = logging.getLogger("weight_transfer")


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The four calls a trainer engine makes on the inference side.

    An implementation reaches every inference worker, blocks until all of them
    are done, and raises when any of them fails.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: UpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


# ---------------------------------------------------------------- trainer side


@dataclass
class TrainerInitInfo:
    """How a caller configures a transfer. `rank` 0 is the only sender.

    Subclasses set the ClassVar `backend` (the factory's dispatch key) and add
    the backend's wire parameters, which the sender ships to the workers.
    """

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = cls.__dict__.get("backend")
        if not isinstance(backend, str) or not backend:
            raise TypeError(
                f"{cls.__name__} must set the ClassVar `backend` to its backend name, "
                'e.g. backend: ClassVar[str] = "nccl"'
            )

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound=TrainerInitInfo)


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    """How a trainer transmits. Built by `trainer_init` on every trainer rank.

    Only the sender (`rank` 0) calls the client and touches the wire; other
    ranks run every trainer-side collective (iterating the source) so the
    trainer's own groups stay aligned. `send_weights` returns only when nothing
    is in flight, and on failure raises the real error without waiting on
    control-plane threads that may never return.

    `trainer_id` names this engine to the workers (`new_trainer_id`); group
    backends ship it, and workers serve one trainer at a time.

    `self.client` is the caller's client seen through `RoundClient`:
    `update_weights` returns once the call is in flight, and the next call
    waits for it (at most `timeout_s`), so a backend transmits while the
    workers receive. `open_round` drives one round with hooks; backends built
    on it supply only their transmit step (`weight_transfer.resync` for
    full-resync backends).
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.trainer_id = new_trainer_id()
        self.client = (
            client
            if isinstance(client, RoundClient)
            else RoundClient(client, timeout_s, trainer_id=self.trainer_id)
        )
        self.source = source
        self.is_sender = is_sender
        self.timeout_s = timeout_s
        self.syncs = 0

    @property
    def backend(self) -> str:
        return self.init_info_cls.backend

    def open_round(self, *, num_params: int, total_bytes: int, num_chunks: int) -> TrainerRound:
        """`start_weight_update` and the round's hooks; see `weight_transfer.rounds`."""
        self.syncs += 1
        tracker = SyncTracker(self.backend, self.syncs, num_params, total_bytes, num_chunks)
        try:
            try:
                self.client.start_weight_update()
            except Exception as error:
                if not (self.can_reconnect and refused(error, Refusal.NO_CONNECTION)):
                    raise
                logger.warning("%s: re-admitting the workers (%s)", self.backend, error)
                with contextlib.suppress(Exception):  # workers of a replica that did start
                    self.client.abort_round("re-admitting the workers after a refused start")
                self.reconnect()
                self.client.start_weight_update()
        except BaseException as error:
            tracker.fail(error)
            raise
        tracker.started()
        return TrainerRound(self.client, tracker, self.timeout_s)

    @property
    def can_reconnect(self) -> bool:
        """Whether this backend re-admits workers at a round boundary (`reconnect`)."""
        return type(self).reconnect is not TrainerWeightTransferEngine.reconnect

    def reconnect(self) -> None:
        """Run the init handshake again with every worker, between rounds.

        Core calls it when a worker has no channel (a replica restarted, a
        group torn down by a failed round): `open_round` when a start is
        refused that way, `ResyncTrainerEngine` when the trainer's own side is
        down. Every other replica keeps serving meanwhile. A backend that can
        re-admit overrides it; the default cannot.
        """
        raise NotImplementedError(f"{self.backend} cannot re-admit workers; run trainer_init again")

    @classmethod
    @abstractmethod
    def trainer_init(
        cls,
        init_info: TTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine[TTrainerInitInfo]:
        """Rendezvous with the inference side and return a ready engine."""

    @abstractmethod
    def send_weights(self, *args: Any, **kwargs: Any) -> None:
        """Push weights through one full start / update / finish round."""

    def shutdown(self) -> None:
        """Release transport resources. The default does nothing."""


# -------------------------------------------------------------- inference side


@dataclass
class WeightTransferConfig:
    """Selects the worker engine by backend name (vLLM's own config works too)."""

    backend: str = "nccl"


@dataclass
class WeightTransferInitInfo:
    """Base of a backend's init info (what the trainer ships once, in the handshake).

    A backend built on core's shared layout and codec also mixes in
    `weight_transfer.wire.WireProtocolInfo`, and its handshake's
    `wire_protocol` is then required and checked before anything is parsed.
    """


@dataclass
class WeightTransferUpdateInfo:
    """Base of a backend's per-round update info."""


@dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: UpdatePayload = field(default_factory=dict)


TInitInfo = TypeVar("TInitInfo", bound=WeightTransferInitInfo)
TUpdateInfo = TypeVar("TUpdateInfo", bound=WeightTransferUpdateInfo)


def trainer_device(device: str | None) -> torch.device:
    """`device`, or by default the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize_device(device: torch.device) -> None:
    """Wait for queued work on `device`; a no-op for devices without a queue (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            accelerator.synchronize(device)


_ROUND_STEPS = ("init_transfer_engine", "start_weight_update", "finish_weight_update", "shutdown")
_NO_ROUND = Refusal.NO_ROUND.say("update_weights called without a matching start_weight_update")
_KEY_ATTR = "_wt_control_key"  # where a parsed init info keeps the trainer's control key


class RoundAbortedError(RuntimeError):
    """The open round was rolled back on request (`ABORT_FIELD`) or for lack of progress."""


class ModelIncompleteError(RuntimeError):
    """A round whose transaction keeps no undo record failed after it loaded: the
    model holds part of it. Generation stays paused until a complete round lands;
    the message carries `Refusal.MODEL_INCOMPLETE`, which is how clients across HTTP know."""


def _watch_rounds(ref: weakref.ReferenceType[WeightTransferEngine[Any, Any]]) -> None:
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


def _round_step(name: str, step: Callable[..., None]) -> Callable[..., None]:
    """Run a subclass's `start_weight_update` / `finish_weight_update` (`name`)
    inside the base class's transaction (see `WeightTransferEngine`); refuse its
    `init_transfer_engine` while a round is open."""

    @functools.wraps(step)
    def wrapper(self: WeightTransferEngine[Any, Any], *args: Any) -> None:
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


def _keyed_parse(parse: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's own `parse_init_info`, given the payload without the trainer's
    control key, which is kept with the parsed info (see `parse_init_info`)."""

    @functools.wraps(parse)
    def wrapper(self: WeightTransferEngine[Any, Any], init_dict: dict[str, Any]) -> Any:
        init_dict, key = pop_control_key(init_dict)
        info = parse(self, init_dict)
        object.__setattr__(info, _KEY_ATTR, key)
        return info

    wrapper.__wt_keyed__ = True  # type: ignore[attr-defined]
    return wrapper


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """How an inference worker receives weights and loads them into its model.

    Lifecycle: `init_transfer_engine` (once per trainer connection), then per
    round `start_weight_update`, `update_weights` (one or more),
    `finish_weight_update`. Wire parameters come from the init info and are
    stored on `self`; update info carries per-round metadata only.

    The round is a transaction that the base class owns, whatever the
    subclass writes: `start_weight_update` opens `self.transaction`
    (`new_transaction()`, by default the model's `WeightLoader`, reachable as
    `self.loader`) before the subclass's own `start_weight_update` runs;
    `finish_weight_update` runs the subclass's, then commits; and any failure
    in start, `update_weights` or finish aborts it (after the subclass's
    `abort_weight_update` hook), so the model serves the weights it had before
    `start_weight_update`. `init_transfer_engine` is refused while a round is
    open. A round with no call in progress for `round_timeout_s` (the init
    info's `timeout_s` where it has one, else 300 s) is rolled back by the
    engine itself, and an update `{ABORT_FIELD: reason}` rolls it back on
    request. A backend that writes to the model directly (a
    spec-style `self.model.load_weights`) is covered too: outside vLLM the
    `DirectLoader` keeps an undo copy, inside vLLM the loader has begun a
    layerwise reload.

    Only the trainer that connected the engine drives its rounds: once an init
    carried a control key, every update and control must carry that trainer's
    MAC, and a finish commits only a round the trainer sealed
    (`weight_transfer.control`); anything else is refused before it is acted on.

    A round that ends without its trainer (an update that failed, the trainer
    gone, no progress for `round_timeout_s`) is rolled back and, inside vLLM,
    generation is resumed if it was paused when the round began; a held commit
    whose trainer left while generation was still paused is reverted
    (`weight_transfer.vllm.serving`).

    A transaction without an exact undo (`exact_undo` False: no copy of the
    weights, for models whose copy does not fit) cannot roll back a round that
    loaded: the engine is then `incomplete` until a round that loads commits
    (a control round, which loads nothing, does not count). Until then it
    resumes nothing, refuses holds, and its refusals carry `Refusal.MODEL_INCOMPLETE`
    (`ModelIncompleteError`), so the clients leave generation paused.
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    supports_draft_weight_update: ClassVar[bool] = True
    defers_processing: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _ROUND_STEPS:
            step = cls.__dict__.get(name)
            if callable(step) and not getattr(step, "__wt_round_step__", False):
                setattr(cls, name, _round_step(name, step))
        parse = cls.__dict__.get("parse_init_info")
        if callable(parse) and not getattr(parse, "__wt_keyed__", False):
            cls.parse_init_info = _keyed_parse(parse)  # type: ignore[method-assign]

    def __init__(
        self,
        config: Any,
        vllm_config: Any,
        device: torch.device | str,
        model: torch.nn.Module,
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.position: WorkerPosition = worker_position(vllm_config)
        self.parallel_config = getattr(vllm_config, "parallel_config", None)
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = torch.device(device)
        self.model = model
        self._default_model = model
        self._default_model_config = self.model_config
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
        self._generation: Any = None  # `weight_transfer.vllm.serving.Generation`, inside vLLM
        self._round_paused = False  # generation was paused when this round began
        self._round_label: str | None = None  # ... under this weight version label
        self._held_paused = False  # ... and has stayed paused since the held commit
        self._held_label: str | None = None  # the label before the held round
        self._sealed = False  # the trainer said this round is complete (`SEAL_FIELD`)
        self._round_loaded = False  # this round's transaction may have changed the model
        self.incomplete: str | None = None  # why the model holds a failed round's part

    # -- target selection (draft model) ---------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """Direct the next round at `model` (the speculative draft model)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Back to the main model. Hosts call this whenever their round ends
        (vLLM's worker after a finish and after any failed start or update, also
        one that failed before reaching the engine, such as a per-worker list it
        could not index): a round still open here is rolled back first."""
        with self._round_lock:
            self._expired = None  # the host's round is over too
            if self.transaction is not None:
                logger.warning(
                    "%s: the host ended the round without finishing it; rolling it back",
                    type(self).__name__,
                )
                self._abort_round(RuntimeError("the host ended the round"))
        self.model = self._default_model
        self.model_config = self._default_model_config

    # -- the transaction -------------------------------------------------
    def new_loader(self) -> WeightLoader:
        """A loader for the current target model (layerwise reload inside vLLM)."""
        return loader_for(self.model, self.vllm_config, self.model_config)

    def new_transaction(self) -> Transaction:
        """The transaction of a new round; by default `new_loader()`."""
        return self.new_loader()

    @property
    def round_open(self) -> bool:
        return self.transaction is not None

    @property
    def loader(self) -> WeightLoader:
        """The open round's loader; `RuntimeError` outside a round."""
        transaction = self.transaction
        if transaction is None:
            raise RuntimeError(f"{type(self).__name__}: no open round (start_weight_update first)")
        if not isinstance(transaction, WeightLoader):
            raise TypeError(f"{type(self).__name__}'s transaction is not a WeightLoader")
        return transaction

    def _open_round(self, subclass_start: Callable[[], None]) -> None:
        with self._round_lock:
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
            self._round_label = generation.label() if self._round_paused else None
            if self.held is not None and not self._round_paused:
                self._held_paused = False  # the fleet resumed: it decided for the new weights
            transaction = self.new_transaction()
            transaction.begin()
            self.transaction = transaction
            self._hold = False
            self._sealed = False
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
            if transaction is not None and self._control is not None and not self._sealed:
                raise ControlRefused(
                    "finish_weight_update before the trainer sealed the round: only the "
                    "trainer this engine serves may finish it (the round stays open for it)"
                )
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

    def release_held(self) -> None:
        """Drop the undo record a held commit kept (`HOLD_FIELD`); idempotent."""
        held, self.held = self.held, None
        if held is not None:
            held.release()

    # -- a round without its trainer --------------------------------------
    def require_connection(self) -> None:
        """Refuse a round this engine cannot receive: one without a connection to its
        trainer (never connected, restarted, torn down by a failed round). Core calls
        it before every round opens. The default asks the backend's `channel` (an
        object with `require()`, such as a `GroupChannel`), whose refusal says
        `Refusal.NO_CONNECTION`; a backend without one is refused the same way
        until an init succeeded, and again after `shutdown`. A trainer that sees
        the refusal re-admits the workers (`reconnect`)."""
        require = getattr(getattr(self, "channel", None), "require", None)
        if callable(require):
            require()
        elif not self.connected:
            raise ChannelDownError(
                Refusal.NO_CONNECTION.say(
                    f"{type(self).__name__}: no trainer is connected (never connected, or "
                    "shut down since): the trainer runs init_weight_transfer_engine again"
                )
            )

    def trainer_alive(self) -> bool | None:
        """Whether the trainer this engine serves still has its end open; None when
        this engine cannot tell. The default asks the backend's `channel` (a
        `GroupChannel`: a group's store, a control link's socket), if it has one."""
        group = getattr(getattr(self, "channel", None), "group", None)
        if group is None:
            return None
        try:
            return bool(group.trainer_alive())
        except Exception:
            return None

    def _find_generation(self) -> Any:
        """vLLM's engine core running this worker, found on a control call's stack. Only
        an engine of one worker acts on it: with several, one worker's resume would run
        requests while another still rolls back (they stay paused instead)."""
        single = self.position.world_size == 1
        if self._generation is None and single and is_vllm_config(self.vllm_config):
            from weight_transfer.vllm.serving import Generation

            self._generation = Generation.of_caller()
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
        generation = self._generation
        if generation is not None and generation.paused() is not False:
            logger.warning("%s: resuming generation (%s)", type(self).__name__, why)
            generation.resume()

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
            check: ControlCheck | None = getattr(init_info, _KEY_ATTR, None)
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
    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Typed init info; `ValueError` naming the field, or the wire-protocol mismatch.

        The trainer's control key (`weight_transfer.control`) is taken out
        first and kept with the parsed info; `init_transfer_engine` installs it
        once the init succeeded.
        """
        init_dict, key = pop_control_key(init_dict)
        declared = issubclass(self.init_info_cls, WireProtocolInfo)
        init_dict = check_wire_protocol(init_dict, required=declared)
        info = parse_payload(self.init_info_cls, init_dict, "init_info")
        object.__setattr__(info, _KEY_ATTR, key)
        return info  # type: ignore[return-value]

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Typed update info; `ValueError` naming the bad or missing field."""
        return parse_payload(self.update_info_cls, update_dict, "update_info")  # type: ignore[return-value]

    # -- the round -------------------------------------------------------
    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, `receive_weights`, then synchronize the device.

        With `defers_processing` the sync is skipped and completion is
        guaranteed by `finish_weight_update` (or `drain_pending`). On any
        failure the round is aborted before the error propagates. A payload
        `{ABORT_FIELD: reason}` rolls the open round back and raises
        `RoundAbortedError`, which closes the host's round too.
        """
        with self._round_lock:
            self._busy = True
            try:
                self._update_locked(update_info)
            finally:
                self._busy = False
                self._progress = time.monotonic()

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
        if isinstance(update_info, dict) and SEAL_FIELD in update_info:
            if self.transaction is None:
                raise RuntimeError(_NO_ROUND)
            self._sealed = True
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

    def _check_still_paused(self) -> None:
        """Refuse to load while requests run: generation was paused when the round began
        and has been resumed since (by a caller of the server's own routes, say)."""
        generation = self._generation
        if self._round_paused and generation is not None and generation.paused() is False:
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

    def drain_pending(self) -> None:
        """Complete deferred work; idempotent, a no-op for synchronous engines."""

    def abort_weight_update(self) -> None:
        """Backend clean-up when a round fails (the base class then aborts the
        transaction). The default does nothing. Idempotent."""

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Open the data channel and record the trainer's wire parameters."""

    def start_weight_update(self) -> None:
        """Prepare a round, after the base class opened its transaction (and checked
        the connection, `require_connection`). The default does nothing."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive this update's weights and load them (`self.loader.load`)."""

    def finish_weight_update(self) -> None:
        """Complete the round; the base class commits the transaction afterwards.
        The default does nothing."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the data channel; serving continues."""


# The defaults run inside the transaction too (subclasses' own are wrapped as defined).
for _name in ("start_weight_update", "finish_weight_update"):
    setattr(WeightTransferEngine, _name, _round_step(_name, WeightTransferEngine.__dict__[_name]))
del _name
