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
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from weight_transfer.loading import Transaction, WeightLoader, loader_for
from weight_transfer.payload import WireProtocolInfo, check_wire_protocol, parse_payload
from weight_transfer.position import WorkerPosition, worker_position
from weight_transfer.rounds import TrainerRound
from weight_transfer.runtime.adapters import adapter_of
from weight_transfer.runtime.control import (
    ABORT_FIELD,
    ModelIncompleteError,
    Refusal,
    RoundAbortedError,
    refused,
)
from weight_transfer.runtime.hooks import SyncTracker
from weight_transfer.runtime.round_client import DEFAULT_TIMEOUT_S, RoundClient, new_trainer_id
from weight_transfer.runtime.sources import ModuleSource, source_view
from weight_transfer.source import (  # the source's names, importable here as in vLLM's base
    ParamMeta,
    Placement,
    Replicate,
    Shard,
    WeightSource,
    layerwise_groups,
    materialize_full_tensor,
)

__all__ = [
    "WeightSource",
    "ParamMeta",
    "ModuleSource",
    "Replicate",
    "Shard",
    "Placement",
    "layerwise_groups",
    "materialize_full_tensor",
    "UpdatePayload",
    "WeightTransferUpdatePayload",
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
    "Channel",
]

UpdatePayload = dict[str, Any] | list[dict[str, Any]]
WeightTransferUpdatePayload = UpdatePayload  # vLLM's name

logger = logging.getLogger("weight_transfer")


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The four calls a trainer engine makes on the inference side.

    An implementation reaches every inference worker, blocks until all of them
    are done, and raises when any of them fails. A trainer engine sees the
    caller's client through `RoundClient` (`self.client`), whose
    `update_weights` does not block: it returns while the call is in flight,
    so the backend transmits while the workers receive.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: UpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


# ---------------------------------------------------------------- trainer side


@dataclass
class TrainerInitInfo:
    """How a caller configures a transfer. `rank` is this process's rank in the
    training job (every trainer rank builds its engine; rank 0 is the only
    sender), not a rank in the transfer's own group.

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

    `self.source` is the caller's source seen wt's way (`source_view`:
    a source written as vLLM 0.33 writes one is viewed through its
    `iter_full` and `owned_names(rank)`, `rank` this trainer rank's).

    `self.client` is the caller's client seen through `RoundClient`:
    `update_weights` returns once the call is in flight, and the next call
    waits for it (at most `timeout_s`), so a backend transmits while the
    workers receive. `open_round` drives one round with hooks; backends built
    on it supply only their transmit step (`weight_transfer.resync` for
    full-resync backends).
    A source with an `adapter` (`LoRASource`) makes each round update that LoRA
    adapter (`weight_transfer.runtime.adapters`); `sends_adapters` False refuses one.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]
    sends_adapters: ClassVar[bool] = True

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool | None = None,
        timeout_s: float | None = None,
        rank: int | None = None,
        info: TTrainerInitInfo | None = None,
    ) -> None:
        """`info`, when given, is kept as `self.info` and supplies what it holds:
        `rank` (and with it `is_sender`) and `timeout_s`; the other arguments
        default to a sender of rank 0 and `DEFAULT_TIMEOUT_S`."""
        self.info = info
        if info is not None:
            rank = info.rank if rank is None else rank
            is_sender = info.is_sender if is_sender is None else is_sender
            timeout_s = getattr(info, "timeout_s", None) if timeout_s is None else timeout_s
        is_sender = True if is_sender is None else is_sender
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.trainer_id = new_trainer_id()
        self.client = (
            client
            if isinstance(client, RoundClient)
            else RoundClient(client, timeout_s, trainer_id=self.trainer_id, backend=self.backend)
        )
        self.source = source_view(source, rank)  # a vLLM 0.33-style source, seen wt's way
        self.client.adapter_source = source
        if adapter_of(source) is not None and not self.sends_adapters:
            raise ValueError(f"{self.backend} cannot send a LoRA adapter; use nccl or ipc")
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
        engine = TrainerWeightTransferEngine
        own = type(self)
        return own.reconnect is not engine.reconnect or own.connect is not engine.connect

    def reconnect(self) -> None:
        """Run the init handshake again with every worker, between rounds.

        Core calls it when a worker has no channel (a replica restarted, a
        group torn down by a failed round): `open_round` when a start is
        refused that way, `ResyncTrainerEngine` when the trainer's own side is
        down. Every other replica keeps serving meanwhile. By default it runs
        `connect()` again; a backend with no `connect` cannot re-admit.
        """
        if type(self).connect is TrainerWeightTransferEngine.connect:
            raise NotImplementedError(
                f"{self.backend} cannot re-admit workers; run trainer_init again"
            )
        self.connect()

    @classmethod
    def trainer_init(
        cls,
        init_info: TTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine[TTrainerInitInfo]:
        """Rendezvous with the inference side and return a ready engine.

        By default: `cls(info=init_info, client=client, source=source)` on every
        rank, then `connect()` on the sender."""
        engine = cls(info=init_info, client=client, source=source)
        if engine.is_sender:
            engine.connect()
        return engine

    def connect(self) -> None:
        """The handshake with every worker, on the sender: run by the default
        `trainer_init`, and again by the default `reconnect` (so it first lets go
        of a channel it made before). The default has none."""

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
    `weight_transfer.payload.WireProtocolInfo`, and its handshake's
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


class Channel(Protocol):
    """The link a worker engine keeps to its trainer (`wt_kits.channel.GroupChannel`):
    `require()` raises `ChannelDownError` when it cannot carry a round; `group`,
    when there is one, answers `trainer_alive()`."""

    group: Any

    def require(self) -> Any: ...


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """How an inference worker receives weights: the receive step a backend writes.

    Lifecycle, as vLLM drives it: `init_transfer_engine` (once per trainer
    connection), then per round `start_weight_update`, `update_weights` (one or
    more: `parse_update_info`, then `receive_weights`), `finish_weight_update`;
    `shutdown`. Wire parameters come from the init info and are stored on
    `self`; update info carries per-round metadata only.

    Hosts never run a backend's engine bare: vLLM (through wt's plugin),
    `WorkerSession` and the factory run it inside wt-core's round
    (`weight_transfer.runtime.worker_round.GuardedEngine`), which calls these
    methods as steps and keeps the guarantees whatever they do: the round is a
    transaction (`new_transaction()`, by default the model's `WeightLoader`,
    reachable as `self.loader` while a round is open) that core begins before
    `start_weight_update`, commits after `finish_weight_update` and rolls back
    after any failure (after `abort_weight_update`), so the model serves the
    weights it had before the round; one trainer per engine, its control key
    and seal; the watchdog; resuming generation. A backend that writes to the
    model directly (a direct `self.model.load_weights`) is covered too:
    outside vLLM the `DirectLoader` keeps an undo copy, inside vLLM the loader
    has begun a layerwise reload. No method here is rewritten: a subclass's
    `super()` calls reach these plain defaults.

    `channel` (declared, None by default) is the backend's link to its
    trainer, if it keeps one: core refuses a round it cannot carry
    (`require_connection`) and asks it whether the trainer is alive
    (`trainer_alive`). A round may update a LoRA adapter instead
    (`weight_transfer.runtime.adapters`): `self.loader` is then the host's
    adapter loader. A backend that does not load through `self.loader.load`
    sets `supports_adapter_update` False.
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    supports_draft_weight_update: ClassVar[bool] = True
    supports_adapter_update: ClassVar[bool] = True
    defers_processing: ClassVar[bool] = False
    channel: Channel | None = None

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
        self.round: Any = None  # the round core runs this engine in (`GuardedEngine`)

    # -- target selection (draft model) ---------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """Direct the next round at `model` (the speculative draft model)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Back to the main model (the host's round ended)."""
        self.model = self._default_model
        self.model_config = self._default_model_config

    # -- the round's transaction, seen from the backend ------------------
    def new_loader(self) -> WeightLoader:
        """A loader for the current target model (layerwise reload inside vLLM)."""
        return loader_for(self.model, self.vllm_config, self.model_config)

    def new_transaction(self) -> Transaction:
        """The transaction of a new round; by default `new_loader()`."""
        return self.new_loader()

    @property
    def transaction(self) -> Transaction | None:
        """The open round's transaction (None outside a round, or outside core's round)."""
        return getattr(self.round, "transaction", None)

    @property
    def loader(self) -> WeightLoader:
        """The open round's loader; `RuntimeError` outside a round."""
        transaction = self.transaction
        if transaction is None:
            raise RuntimeError(f"{type(self).__name__}: no open round (start_weight_update first)")
        if not isinstance(transaction, WeightLoader):
            raise TypeError(f"{type(self).__name__}'s transaction is not a WeightLoader")
        return transaction

    # -- what core asks the backend ----------------------------------------
    def require_connection(self) -> None:
        """Refuse a round this engine cannot receive: one without a connection to its
        trainer. The default asks `channel` (`require()`, which says
        `Refusal.NO_CONNECTION`); an engine without one is refused the same way by
        core until an init succeeded, and again after `shutdown`. A trainer that
        sees the refusal re-admits the workers (`reconnect`)."""
        if self.channel is not None:
            self.channel.require()

    def trainer_alive(self) -> bool | None:
        """Whether the trainer this engine serves still has its end open; None when
        this engine cannot tell. The default asks `channel`'s group, if there is one."""
        group = getattr(self.channel, "group", None)
        if group is None:
            return None
        try:
            return bool(group.trainer_alive())
        except Exception:
            return None

    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Typed init info; `ValueError` naming the field, or the wire-protocol mismatch."""
        declared = issubclass(self.init_info_cls, WireProtocolInfo)
        init_dict = check_wire_protocol(init_dict, required=declared)
        return parse_payload(self.init_info_cls, init_dict, "init_info")  # type: ignore[return-value]

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Typed update info; `ValueError` naming the bad or missing field."""
        return parse_payload(self.update_info_cls, update_dict, "update_info")  # type: ignore[return-value]

    # -- the steps -------------------------------------------------------
    def update_weights(self, update_info: dict[str, Any]) -> None:
        """`parse_update_info`, then `receive_weights` (what core's round runs, with
        its checks around them, for every update a host delivers)."""
        self.receive_weights(self.parse_update_info(update_info))

    def drain_pending(self) -> None:
        """Complete deferred work (`defers_processing`); idempotent, a no-op for
        synchronous engines. Core runs it before `finish_weight_update`."""

    def abort_weight_update(self) -> None:
        """Backend clean-up when a round fails (core then aborts the transaction).
        The default does nothing. Idempotent."""

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Open the data channel and record the trainer's wire parameters."""

    def start_weight_update(self) -> None:
        """Prepare a round, after core opened its transaction (and checked the
        connection, `require_connection`). The default does nothing."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive this update's weights and load them (`self.loader.load`)."""

    def finish_weight_update(self) -> None:
        """Complete the round; core commits the transaction afterwards. The default
        does nothing."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the data channel; serving continues."""
