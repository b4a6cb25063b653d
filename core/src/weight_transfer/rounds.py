"""The trainer's side of a round: the transfer and the round a backend drives.

Core drives every round the same way, whatever the backend:

    round = engine.open_round(...)          # start_weight_update; hooks: started
    round.update(update_info, transmit)     # update_weights in flight while
                                            # transmit(transfer) moves the bytes
    round.finish(weight_version)            # waits for update_weights, seals the
                                            # round, then finish_weight_update(weight_version)

Rules every round keeps, so no backend has to:

- `update_weights` runs on a daemon thread while the backend transmits
  (`weight_transfer.runtime.round_client`); the workers' answer is awaited only on the success path,
  at most `timeout_s`. On an error path nothing waits on a control-plane call:
  the error is raised at once; after a failed update the workers are told to
  roll back from a daemon thread, and the client's next init or start first
  lets that end (bounded).
- A transmit step watches the call through `Transfer.wait`, so a worker that
  fails surfaces its own error at once rather than after a transport timeout.
- A transmit step that ended the round in step with the workers (an in-band
  abort notice, say) raises `AlignedFailure(error)`; the round raises `error`.
- Hooks: `wt_sync_started` once the round is open, `wt_chunk_moved` per
  `Transfer.chunk_moved`, then `wt_sync_finished` or `wt_sync_failed`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from weight_transfer.runtime.hooks import SyncTracker
from weight_transfer.runtime.round_client import UPDATE_CALL, RoundClient
from weight_transfer.runtime.waiting import PEER_GRACE_S, await_transfer

__all__ = ["Transfer", "AlignedFailure", "TrainerRound"]

T = TypeVar("T")


class AlignedFailure(Exception):
    """The round failed, but trainer and workers stopped at the same point.

    Raised by a transmit step (or a transport piece) that ended the round in
    step with the workers: the channel can carry the next round. The round
    raises `error` in its place.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Transfer:
    """What one `update` hands the backend's transmit step."""

    timeout_s: float
    tracker: SyncTracker
    watch: Mapping[str, Future[Any]] = field(default_factory=dict)

    def wait(self, future: Future[T], what: str, *, watching: bool = True) -> T:
        """`future`'s result, at most `timeout_s`; a failed worker call raises at once.

        When `future` itself fails (a send to a worker that dropped its end),
        the workers' call gets `PEER_GRACE_S` to say why, and its error is
        raised instead, chained to the transport's. `watching=False` ignores
        the workers' call: for a send whose purpose is to make them fail (an
        abort notice), their error is the expected answer.
        """
        if not watching:
            return await_transfer(future, watch={}, timeout_s=self.timeout_s, what=what)
        try:
            return await_transfer(future, watch=self.watch, timeout_s=self.timeout_s, what=what)
        except Exception as error:
            if self.worker_error() is error:
                raise
            reported = self.worker_error(within_s=PEER_GRACE_S)
            if reported is None:
                raise
            raise reported from error

    def worker_error(self, within_s: float = 0.0) -> BaseException | None:
        """The workers' error if their `update_weights` fails within `within_s`, else None."""
        deadline = time.monotonic() + within_s
        for future in self.watch.values():
            with contextlib.suppress(FutureTimeout):
                error = future.exception(timeout=max(0.0, deadline - time.monotonic()))
                if error is not None:
                    return error
        return None

    def chunk_moved(self, nbytes: int) -> None:
        self.tracker.chunk_moved(nbytes)


class TrainerRound:
    """One open round on the inference side; see the module docstring.

    Any failure ends the round (hooks: `wt_sync_failed`); later calls raise.
    """

    def __init__(self, client: RoundClient, tracker: SyncTracker, timeout_s: float) -> None:
        self.client = client
        self.tracker = tracker
        self.timeout_s = timeout_s
        self.closed = False

    @classmethod
    def unreported(cls, client: RoundClient, backend: str, timeout_s: float) -> TrainerRound:
        """A round the caller opened through the client itself: its steps, no hooks."""
        return cls(client, SyncTracker(backend, 0, 0, 0, 0, enabled=False), timeout_s)

    def _guard(self, step: Callable[[], T], *, finishing: bool = False) -> T:
        if self.closed:
            raise RuntimeError("this round has ended; open a new one")
        try:
            return step()
        except AlignedFailure as failed:
            self._fail(failed.error, finishing)
            raise failed.error from None
        except BaseException as error:
            self._fail(error, finishing)
            raise

    def _fail(self, error: BaseException, finishing: bool) -> None:
        """End the round; the workers are told to roll back unless the failure was
        their finish, which ends the round there either way."""
        self.closed = True
        reason = f"the trainer's round failed: {type(error).__name__}: {error}"
        self.client.abandon(None if finishing else reason)
        try:
            self.client.round_failed(error)
        finally:
            self.tracker.fail(error)

    def abort(self, reason: str) -> None:
        """End the round without committing it: every worker rolls it back."""
        if not self.closed:
            self._fail(RuntimeError(reason), finishing=False)

    def update(self, update_info: Any, transmit: Callable[[Transfer], None]) -> None:
        """`update_weights(update_info)` while `transmit` moves its bytes; then its answer."""

        def step() -> None:
            self.client.update_weights(update_info)
            assert self.client.pending is not None
            transmit(Transfer(self.timeout_s, self.tracker, {UPDATE_CALL: self.client.pending}))
            self.client.wait_update()

        self._guard(step)

    def finish(self, weight_version: str | None = None) -> None:
        """`finish_weight_update(weight_version)`: the workers commit weights and label."""
        self._guard(lambda: self.client.finish_weight_update(weight_version), finishing=True)
        self.closed = True
        self.tracker.weight_version = weight_version
        self.tracker.finish()
