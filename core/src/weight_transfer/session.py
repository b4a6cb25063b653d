"""`WorkerSession`: the inference-side state machine around one worker engine.

vLLM's worker runs this state machine for its engine; `WorkerSession` is the
same contract for hosts that embed an engine themselves (a custom worker, a
test process). It satisfies `VLLMWeightSyncClient`, so a trainer can drive an
in-process worker directly.

Rules: `start_weight_update` opens a round (error if one is open);
`update_weights` and `finish_weight_update` need an open round; a failed
`update_weights` or `finish_weight_update` closes the round (core's round
has rolled it back), except a finish refused for want of its
trainer's seal, which leaves the round open for the trainer (as vLLM's does);
`shutdown_weight_transfer_engine` is refused while a round is open.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.base import (
    UpdatePayload,
    WeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from weight_transfer.runtime.control import ControlRefused, Refusal
from weight_transfer.runtime.worker_round import GuardedEngine, guarded

__all__ = ["WorkerSession"]


class WorkerSession:
    def __init__(
        self, engine: WeightTransferEngine[Any, Any] | GuardedEngine, draft_model: Any = None
    ) -> None:
        self.engine = guarded(engine)  # a backend's engine runs inside core's round
        self.draft_model = draft_model
        self.weight_version: str | None = None
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def init_weight_transfer_engine(
        self, init_info: dict[str, Any] | WeightTransferInitRequest
    ) -> None:
        if isinstance(init_info, WeightTransferInitRequest):
            init_info = init_info.init_info
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._start(draft=False)

    def start_draft_weight_update(self) -> None:
        self._start(draft=True)

    def _start(self, *, draft: bool) -> None:
        if self._active:
            raise RuntimeError(
                Refusal.ROUND_OPEN.say(
                    "start_weight_update called while a weight update is active; "
                    "call finish_weight_update first"
                )
            )
        if draft:
            if not self.engine.supports_draft_weight_update:
                raise RuntimeError(
                    f"{type(self.engine.backend).__name__} does not support draft-model updates"
                )
            if self.draft_model is None:
                raise RuntimeError("draft weight update requested, but there is no draft model")
            self.engine.set_weight_update_target(self.draft_model, None)
        try:
            self.engine.start_weight_update()
        except BaseException:
            self.engine.reset_weight_update_target()
            raise
        self._active = True

    def update_weights(self, update_info: UpdatePayload | WeightTransferUpdateRequest) -> None:
        if isinstance(update_info, WeightTransferUpdateRequest):
            update_info = update_info.update_info
        if not self._active:
            raise RuntimeError(
                Refusal.NO_ROUND.say("start_weight_update must be called before update_weights")
            )
        if isinstance(update_info, list):
            position = self.engine.position
            if len(update_info) != position.total_workers:
                raise ValueError(
                    f"update_info: a per-worker list needs {position.total_workers} entries "
                    f"(one per worker), got {len(update_info)}"
                )
            update_info = update_info[position.global_index]
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self._active = False
            self.engine.reset_weight_update_target()
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self._active:
            raise RuntimeError(
                Refusal.NO_ROUND.say(
                    "finish_weight_update called without a matching start_weight_update"
                )
            )
        try:
            self.engine.finish_weight_update()  # a failed finish has rolled back
        except ControlRefused:
            raise  # a finish before its trainer's seal: the round stays open for the trainer
        except BaseException:
            self._end_round()
            raise
        self._end_round()
        if weight_version is not None:
            self.weight_version = weight_version

    def abandon_round(self) -> None:
        """End an open round from the host's side, as vLLM's worker does after a failed
        call: the engine rolls it back. A no-op without an open round."""
        if self._active:
            self._end_round()

    def _end_round(self) -> None:
        self._active = False
        self.engine.reset_weight_update_target()

    def set_weight_version(self, version: str) -> None:
        """Set the version label (a fleet restores it when it reverts a round)."""
        self.weight_version = version

    def shutdown_weight_transfer_engine(self) -> None:
        if self._active:
            raise RuntimeError("cannot shut the weight transfer engine down during an update")
        self.engine.shutdown()
