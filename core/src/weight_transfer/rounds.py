"""The trainer's side of a round: the sender's client, the transfer, the round.

Core drives every round the same way, whatever the backend:

    round = engine.open_round(...)          # start_weight_update; hooks: started
    round.update(update_info, transmit)     # update_weights in flight while
                                            # transmit(transfer) moves the bytes
    round.finish(weight_version)            # waits for update_weights, seals the
                                            # round, then finish_weight_update(weight_version)

Rules every round keeps, so no backend has to:

- `update_weights` runs on a daemon thread while the backend transmits
  (`RoundClient`); the workers' answer is awaited only on the success path,
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
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from weight_transfer.control import (
    ABORT_FIELD,
    HOLD_FIELD,
    RELEASE_FIELD,
    REVERT_FIELD,
    SEAL_FIELD,
    ControlKey,
    abort_round,
    finish_round,
    start_round,
    with_control_key,
)
from weight_transfer.hooks import SyncTracker
from weight_transfer.waiting import PEER_GRACE_S, await_transfer, in_background

__all__ = [
    "RoundClient",
    "Transfer",
    "AlignedFailure",
    "TrainerRound",
    "DEFAULT_TIMEOUT_S",
    "ABORT_FIELD",
    "HOLD_FIELD",
    "REVERT_FIELD",
    "RELEASE_FIELD",
    "new_trainer_id",
    "Replicas",
    "fleet_of",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 300.0
UPDATE_CALL = "the workers' update_weights"


def new_trainer_id() -> str:
    """A name for one trainer engine, unique across hosts and restarts: host, pid, nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RoundClient:
    """The caller's `VLLMWeightSyncClient` as a trainer engine uses it.

    Every payload it sends is signed with its `control` key, which its
    `init_weight_transfer_engine` ships to the workers
    (`weight_transfer.control`); `finish_weight_update` seals the round first.

    `update_weights` starts the call on a daemon thread and returns, so the
    backend can transmit while the workers receive; `pending` is that call.
    The next `update_weights` or `finish_weight_update` first waits for it (at
    most `timeout_s`) and raises its error. `start_weight_update` first lets a
    call left over from a failed round end, bounded, ignoring its outcome (it
    belonged to that round), and aborts a round the host still holds open
    (`abort_round`) before starting its own. Other attributes are the caller's
    client's.
    """

    def __init__(
        self, client: Any, timeout_s: float = DEFAULT_TIMEOUT_S, *, trainer_id: str = ""
    ) -> None:
        self.inner = client
        self.timeout_s = timeout_s
        self.pending: Future[None] | None = None
        self._leftover: Future[None] | None = None
        self.control = ControlKey(trainer_id)
        if hasattr(type(client), "bind_control"):  # a client sending controls of its own
            client.bind_control(self.control)  # (a fleet) signs them with this key

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _let_leftover_end(self) -> None:
        """Let what a failed round left on its own thread end (bounded), ignoring its
        outcome: the caller's client never carries two calls at once."""
        leftover, self._leftover = self._leftover, None
        if leftover is not None:
            with contextlib.suppress(Exception):
                leftover.exception(timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._let_leftover_end()
        self.inner.init_weight_transfer_engine(with_control_key(init_info, self.control))

    def start_weight_update(self) -> None:
        """Start a round; one left open on the workers (a trainer that died
        mid-round, an update refused before it reached them) is aborted first."""
        self._let_leftover_end()
        start_round(self.inner.start_weight_update, self.abort_round)

    def abort_round(self, reason: str) -> None:
        """End the round open on the workers, rolling it back (`ABORT_FIELD`)."""
        abort_round(self.inner.update_weights, reason, self.control.sign)

    def update_weights(self, update_info: Any) -> None:
        self.wait_update()
        signed = self.control.sign(update_info)
        self.pending = in_background(
            lambda: self.inner.update_weights(signed), name="wt-update-rpc"
        )

    def wait_update(self) -> None:
        """Wait for the call in flight (at most `timeout_s`); raise its error."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            await_transfer(pending, watch={}, timeout_s=self.timeout_s, what=UPDATE_CALL)
        except BaseException:
            self._leftover = pending
            raise

    def abandon(self, reason: str | None) -> None:
        """End a failed round without waiting on it (an error path); `reason`: why,
        or None when the workers ended the round themselves (a failed finish).

        On a daemon thread, the call in flight is let end (bounded), then every
        worker is told to roll the round back (`abort_round`), so a worker whose
        part succeeded returns to its previous weights at once instead of when
        its watchdog sees the round stall. The next start waits for both
        (bounded). A client that ends failed rounds itself (`round_failed`: a
        fleet) is left to do so.
        """
        pending, self.pending = self.pending, None
        if reason is None or callable(getattr(self.inner, "round_failed", None)):
            self._leftover = pending
            return

        def end() -> None:
            if pending is not None:
                with contextlib.suppress(Exception):  # it belonged to the failed round
                    pending.exception(timeout=self.timeout_s)
            self.abort_round(reason)

        self._leftover = in_background(end, name="wt-abort-rpc")

    def round_failed(self, error: BaseException) -> None:
        """Tell a client that ends rounds itself (`FanOutClient.round_failed`: every
        replica back on its previous weights) that the trainer's round failed."""
        ending = getattr(self.inner, "round_failed", None)
        if callable(ending):
            ending(error)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Seal the round (`SEAL_FIELD`: nothing more comes), then finish it."""
        self.wait_update()
        self.inner.update_weights(self.control.sign({SEAL_FIELD: True}))
        finish_round(self.inner.finish_weight_update, weight_version)


class Replicas(Protocol):
    """A client of several engines, each with its own handshake (`FanOutClient`)."""

    replicas: Sequence[Any]

    def init_replicas(self, payloads: Sequence[dict[str, Any]]) -> None: ...


def fleet_of(client: Any) -> Replicas | None:
    """The replica set behind `client` (seen through `RoundClient` or not), if any."""
    inner = client.inner if isinstance(client, RoundClient) else client
    if callable(getattr(inner, "init_replicas", None)) and hasattr(inner, "replicas"):
        return inner
    return None


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
