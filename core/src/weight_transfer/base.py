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

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from weight_transfer.loading import WeightLoader, loader_for
from weight_transfer.payload import parse_payload
from weight_transfer.position import WorkerPosition, worker_position
from weight_transfer.source import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    layerwise_groups,
    materialize_full_tensor,
)
from weight_transfer.transport.wire import WIRE_PROTOCOL_VERSION, check_wire_protocol

__all__ = [
    "ParamMeta",
    "WeightSource",
    "ModuleSource",
    "layerwise_groups",
    "materialize_full_tensor",
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
]

UpdatePayload = dict[str, Any] | list[dict[str, Any]]


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
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool = True,
    ) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender

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
    """Base of a backend's init info. `wire_protocol` is checked before parsing."""

    wire_protocol: int = field(default=WIRE_PROTOCOL_VERSION, kw_only=True)


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


def synchronize_device(device: torch.device) -> None:
    """Wait for queued work on `device`; a no-op for devices without a queue (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            accelerator.synchronize(device)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """How an inference worker receives weights and loads them into its model.

    Lifecycle: `init_transfer_engine` (once per trainer connection), then per
    round `start_weight_update`, `update_weights` (one or more),
    `finish_weight_update`. Wire parameters come from the init info and are
    stored on `self`; update info carries per-round metadata only.

    If `update_weights` raises, the engine has already aborted the round: the
    model serves the weights it had before `start_weight_update`.
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    supports_draft_weight_update: ClassVar[bool] = True
    defers_processing: ClassVar[bool] = False

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

    # -- target selection (draft model) ---------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """Direct the next round at `model` (the speculative draft model)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        self.model = self._default_model
        self.model_config = self._default_model_config

    def new_loader(self) -> WeightLoader:
        """A loader for the current target model (layerwise reload inside vLLM)."""
        return loader_for(self.model, self.vllm_config, self.model_config)

    # -- payload parsing ---------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Typed init info; `ValueError` naming the field, or the wire-protocol mismatch."""
        check_wire_protocol(init_dict)
        return parse_payload(self.init_info_cls, init_dict, "init_info")  # type: ignore[return-value]

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Typed update info; `ValueError` naming the bad or missing field."""
        return parse_payload(self.update_info_cls, update_dict, "update_info")  # type: ignore[return-value]

    # -- the round -------------------------------------------------------
    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, `receive_weights`, then synchronize the device.

        With `defers_processing` the sync is skipped and completion is
        guaranteed by `finish_weight_update` (or `drain_pending`). On any
        failure the round is aborted (`abort_weight_update`) before re-raising.
        """
        try:
            info = self.parse_update_info(update_info)
            self.receive_weights(info)
            if not self.defers_processing:
                synchronize_device(self.device)
        except BaseException as error:
            try:
                self.abort_weight_update()
            except BaseException as abort_error:
                raise RuntimeError(
                    f"update_weights failed ({type(error).__name__}: {error}) and rolling "
                    f"back failed too ({type(abort_error).__name__}: {abort_error})"
                ) from error
            raise

    def drain_pending(self) -> None:
        """Complete deferred work; idempotent, a no-op for synchronous engines."""

    def abort_weight_update(self) -> None:
        """Discard the open round so the model serves its previous weights.

        Called by `update_weights` on failure. The default does nothing: an
        engine that changes the model before `finish_weight_update` overrides it.
        """

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Open the data channel and record the trainer's wire parameters."""

    @abstractmethod
    def start_weight_update(self) -> None:
        """Prepare a round (checkpoint-format engines: begin the reload)."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive this update's weights and load them into `self.model`."""

    @abstractmethod
    def finish_weight_update(self) -> None:
        """Complete the round; the model serves the new weights afterwards."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the data channel; serving continues."""
