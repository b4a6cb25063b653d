"""The caller's client as a trainer engine uses it: `RoundClient`.

Every trainer engine sees its client through a `RoundClient`, so every
backend's round gets, without writing it: the control key shipped in init and
a MAC on every update and control (`weight_transfer.runtime.control`);
`update_weights` in flight on a daemon thread while the backend transmits; a
round left open on the workers aborted before the next start; a failed
round's abort sent from a daemon thread (`abandon`); the seal before finish;
and, for a source that updates a LoRA adapter, the round's adapter target
(`weight_transfer.runtime.adapters`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from weight_transfer.runtime.adapters import ADAPTER_FIELD, Adapter, adapter_of
from weight_transfer.runtime.control import (
    SEAL_FIELD,
    VERSION_FIELD,
    ControlKey,
    ForeignEngineError,
    Refusal,
    abort_round,
    finish_round,
    foreign_engine,
    refused,
    start_round,
    with_control_key,
)
from weight_transfer.runtime.waiting import await_transfer, in_background

__all__ = [
    "RoundClient",
    "DEFAULT_TIMEOUT_S",
    "UPDATE_CALL",
    "new_trainer_id",
    "Replicas",
    "fleet_of",
]

DEFAULT_TIMEOUT_S = 300.0
UPDATE_CALL = "the workers' update_weights"


def new_trainer_id() -> str:
    """A name for one trainer engine, unique across hosts and restarts: host, pid, nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RoundClient:
    """The caller's `VLLMWeightSyncClient` as a trainer engine uses it.

    Every payload it sends is signed with its `control` key, which its
    `init_weight_transfer_engine` ships to the workers
    (`weight_transfer.runtime.control`); `finish_weight_update` seals the round first.

    `update_weights` starts the call on a daemon thread and returns, so the
    backend can transmit while the workers receive; `pending` is that call.
    The next `update_weights` or `finish_weight_update` first waits for it (at
    most `timeout_s`) and raises its error. `start_weight_update` first lets a
    call left over from a failed round end, bounded, ignoring its outcome (it
    belonged to that round), and aborts a round the host still holds open
    (`abort_round`) before starting its own. When `adapter_source` (the
    trainer's source, which the trainer engine sets) has an `adapter`, the
    round updates that adapter (read at each start, so a source may switch
    adapters between rounds): the caller's client checks it first
    (`check_adapter(adapter)`, if it has one: the HTTP client refuses a name
    its server serves a base model under), the target goes out right after the
    start, and after a successful finish the caller's client is told
    (`adapter_landed(adapter)`, if it has one: the HTTP client points the
    name at the adapter on its server). Other attributes are the caller's client's.
    """

    def __init__(
        self,
        client: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        trainer_id: str = "",
        backend: str = "",
    ) -> None:
        self.inner = client
        self.backend = backend  # the trainer's backend, named in a foreign engine's refusal
        self.timeout_s = timeout_s
        self.pending: Future[None] | None = None
        self._leftover: Future[None] | None = None
        self.control = ControlKey(trainer_id)
        self.adapter_source: Any = None  # the trainer's source, asked for its adapter
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
        """Ship `init_info` with the control key; a host running another engine than
        wt's refuses it before any init: `ForeignEngineError` naming both."""
        self._let_leftover_end()
        try:
            self.inner.init_weight_transfer_engine(with_control_key(init_info, self.control))
        except Exception as error:
            engine = foreign_engine(error)
            if engine is None:
                raise
            wanted = f"wt_{self.backend}" if self.backend else "wt_<backend>"
            raise ForeignEngineError(
                f"the inference engine runs {engine}, not a wt engine, so it cannot take "
                f"this trainer's init info; start it with weight_transfer_config "
                f"""{{"backend": "{wanted}"}} (vLLM's --weight-transfer-config '{{"backend": """
                f""""{wanted}"}}')"""
            ) from error

    def start_weight_update(self) -> None:
        """Start a round; one left open on the workers (a trainer that died
        mid-round, an update refused before it reached them) is aborted first.
        A start that fails after the workers opened the round (the caller's
        client failed to pause) aborts it (`abandon`), unless the workers have
        no connection: the trainer re-admits them and aborts it then."""
        self._let_leftover_end()
        adapter = self.adapter
        check = getattr(self.inner, "check_adapter", None)
        if adapter is not None and callable(check):
            check(adapter)  # before anything opens
        try:
            start_round(self.inner.start_weight_update, self.abort_round)
        except Exception as error:
            if not refused(error, Refusal.NO_CONNECTION):
                self.abandon(f"the round's start failed: {type(error).__name__}: {error}")
            raise
        if adapter is not None:
            self._target(adapter)

    @property
    def adapter(self) -> Adapter | None:
        """The adapter the trainer's source updates, or None (model weights)."""
        return adapter_of(self.adapter_source)

    def _target(self, adapter: Adapter) -> None:
        """Direct the open round at `adapter`; a refusal has closed the round there."""
        self.inner.update_weights(self.control.sign({ADAPTER_FIELD: adapter.to_payload()}))

    def abort_round(self, reason: str) -> None:
        """End the round open on the workers, rolling it back (`ABORT_FIELD`); what a
        failed round left in flight ends first (bounded), as before every call."""
        self._let_leftover_end()
        abort_round(self.inner.update_weights, reason, self.control.sign)

    def update_weights(self, update_info: Any) -> None:
        """Does not block on the workers: waits for the previous update (bounded),
        starts the caller's blocking `update_weights` on a thread and returns;
        `wait_update()` (and the next call) block for it."""
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
            abort_round(self.inner.update_weights, reason, self.control.sign)

        self._leftover = in_background(end, name="wt-abort-rpc")

    def round_failed(self, error: BaseException) -> None:
        """Tell a client that ends rounds itself (`FanOutClient.round_failed`: every
        replica back on its previous weights) that the trainer's round failed."""
        ending = getattr(self.inner, "round_failed", None)
        if callable(ending):
            ending(error)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Seal the round (`SEAL_FIELD`: nothing more comes; `VERSION_FIELD`: the
        label this finish applies), then finish it."""
        self.wait_update()
        self.inner.update_weights(self._seal(weight_version))
        finish_round(self.inner.finish_weight_update, weight_version)
        adapter = self.adapter
        if adapter is not None:
            self._landed(adapter)

    def _seal(self, weight_version: str | None) -> dict[str, Any]:
        return self.control.sign({SEAL_FIELD: True, VERSION_FIELD: weight_version})

    def _landed(self, adapter: Adapter) -> None:
        landed = getattr(self.inner, "adapter_landed", None)
        if callable(landed):
            landed(adapter)

    def adapter_round(self, adapter: Adapter) -> None:
        """A round that only targets `adapter` and loads nothing: a removal. The
        caller's client is told first (the HTTP server refuses the name from then
        on). A client with a `removal_pause` mode (the HTTP client's `"wait"`)
        pauses in it for this round, so requests in flight on the adapter finish
        before it goes."""
        self._landed(adapter)
        pause = getattr(self.inner, "pause", None)
        drain = getattr(self.inner, "removal_pause", None)
        if pause is not None and drain is not None:
            self.inner.pause = drain
        try:
            self._let_leftover_end()
            start_round(self.inner.start_weight_update, self.abort_round)
            self._target(adapter)  # a refusal has closed the round on the workers
            self.inner.update_weights(self._seal(None))
            finish_round(self.inner.finish_weight_update, None)
        finally:
            if pause is not None and drain is not None:
                self.inner.pause = pause


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
