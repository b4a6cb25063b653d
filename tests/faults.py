"""`FaultyReplica`: a replica's client that fails once, where and how a fleet test says."""

from __future__ import annotations

from typing import Any

from weight_transfer import WeightSyncRPCError
from weight_transfer.base import ABORT_FIELD


class FaultyReplica:
    """Wraps a replica's client; `fault = (phase, how)` fails the next call of that phase:

    - "unreachable": the call never reaches the replica (a dead connection);
    - "refused": the replica gets an update without its 'names' field and refuses it itself;
    - "lost": the replica does the call (a finish), but its answer is lost on the way back.

    `unreachable_for_aborts = n` makes the next `n` in-band aborts never arrive.
    Every other attribute is the wrapped client's (pause, labels, control rounds).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fault: tuple[str, str] | None = None
        self.unreachable_for_aborts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _trip(self, phase: str) -> str | None:
        if self.fault is None or self.fault[0] != phase:
            return None
        how, self.fault = self.fault[1], None
        if how == "unreachable":
            raise WeightSyncRPCError(phase, "ConnectError: [Errno 111] Connection refused")
        return how

    def start_weight_update(self) -> None:
        self._trip("start")
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        aborting = isinstance(update_info, dict) and ABORT_FIELD in update_info
        if aborting and self.unreachable_for_aborts > 0:
            self.unreachable_for_aborts -= 1
            raise WeightSyncRPCError("update_weights", "ConnectError: connection refused")
        data = isinstance(update_info, dict) and "names" in update_info
        if data and self._trip("update") == "refused":
            update_info = {k: v for k, v in update_info.items() if k != "names"}
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None, **kwargs: Any) -> None:
        how = self._trip("finish")
        self.inner.finish_weight_update(weight_version, **kwargs)
        if how == "lost":
            raise WeightSyncRPCError("finish_weight_update", "ReadTimeout: the answer was lost")
