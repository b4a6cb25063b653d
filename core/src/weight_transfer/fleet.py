"""All-or-nothing rounds across inference replicas: `FanOutClient`.

A fleet round moves every replica to the new weights and version label, or
none: if any replica fails in any phase, every replica ends the round on its
previous weights and label, and `FleetError` names the replica and the phase.
Each phase runs on every replica at once:

1. **start**: read each replica's version label (clients with
   `weight_version()`), `start_weight_update` (the replica's client pauses
   generation), then `{HOLD_FIELD: True}`: the replica's commit will keep its
   undo record. A failure: every replica whose round opened is aborted in
   band (`ABORT_FIELD`), which rolls it back and resumes its generation.
2. **update**: each `update_weights` on every replica. The first failure is
   raised at once: the trainer's transmit step is waiting on this call and
   must stop sending, so that replicas still receiving fail too. The other
   calls settle in the background, then every replica whose round is still
   open is aborted in band. `round_failed` (the trainer's round calls it on
   any failure) and the next start wait for that, bounded.
3. **finish**: `finish_weight_update(version)` everywhere; each replica
   commits and holds its undo record, and (clients with `resumes_on_request`)
   stays paused, so no request runs on weights that may yet be reverted.
   All succeeded: every replica resumes, then releases its record
   (`RELEASE_FIELD`, in a round of its own that loads nothing and does not
   pause generation). Any failed: every replica that finished reverts
   (`REVERT_FIELD`, prefix cache reset, then resumed) and gets its previous
   label back; every replica still in its round is aborted, and reverted
   too if it holds a record (a finish whose answer was lost committed).

A replica that cannot be reached to roll back (it died) is named in the
error; a restarted one rejoins at the next round (see
`TrainerWeightTransferEngine.reconnect`).

Replica clients: any `VLLMWeightSyncClient`; the built-in ones
(`HTTPVLLMWeightSyncClient`, `RayVLLMWeightSyncClient` per handle,
`LocalVLLMWeightSyncClient`) also restore version labels and run release
rounds without pausing. `FanOutClient.http(urls)` and `FanOutClient.ray(handles)`
build a fleet of them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from weight_transfer.base import UpdatePayload
from weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
    WeightSyncRPCError,
)
from weight_transfer.runtime.control import (
    HOLD_FIELD,
    RELEASE_FIELD,
    REVERT_FIELD,
    ControlKey,
    Refusal,
    abort_round,
    control_round,
    finish_round,
    start_round,
    with_control_key,
)
from weight_transfer.runtime.round_client import DEFAULT_TIMEOUT_S
from weight_transfer.runtime.waiting import PEER_GRACE_S, first_failure, in_background, settle

__all__ = ["FanOutClient", "FleetError", "PHASES"]

logger = logging.getLogger("weight_transfer")

T = TypeVar("T")
PHASES = ("init", "start", "update", "finish")
_CONFIRM_PERIOD_S = 1.0  # between two reads of a replica whose rollback is unconfirmed
_CONFIRM_WITHIN_S = 30.0  # how long such a replica is asked again


class FleetError(WeightSyncRPCError):
    """A fleet round failed: `phase` (one of `PHASES`), `replica` (its index), `cause`.

    Every replica the fleet could reach is back on its previous weights and
    label; `unrecovered` names any it could not roll back.
    """

    def __init__(
        self,
        phase: str,
        replica: int,
        name: str,
        cause: BaseException,
        unrecovered: list[str],
        *,
        rolling_back: bool = False,
    ) -> None:
        self.phase = phase
        self.replica = replica
        self.name = name
        self.cause = cause
        self.unrecovered = list(unrecovered)
        self.rolling_back = rolling_back
        super().__init__(f"{phase} phase", self._detail())

    def _detail(self) -> str:
        detail = f"replica {self.replica} ({self.name}): {type(self.cause).__name__}: {self.cause}"
        if self.unrecovered:
            return detail + "; NOT rolled back: " + "; ".join(self.unrecovered)
        if self.rolling_back:
            return detail + "; every replica is being rolled back to its previous weights"
        if self.phase != "init":
            return detail + "; every replica is back on its previous weights"
        return detail

    def add_unrecovered(self, failures: list[str]) -> None:
        """Record rollbacks that failed after this error was raised (the message follows)."""
        self.unrecovered += failures
        self.detail = self._detail()
        self.args = (f"{self.method} failed on the inference side: {self.detail}",)


class FanOutClient:
    """Several inference engines (replicas) as one client, all-or-nothing; see the module doc.

    `replicas` are the clients, in replica order (a backend whose handshake
    differs per replica calls them one by one, or `init_replicas`). `names`
    label them in errors (default: a client's `base_url`, else its index).
    `timeout_s` bounds each wait for the replicas' calls (each client also
    bounds its own). With `all_or_nothing=False` calls are only fanned out.
    """

    def __init__(
        self,
        replicas: Sequence[Any],
        *,
        names: Sequence[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        all_or_nothing: bool = True,
    ) -> None:
        if not replicas:
            raise ValueError("FanOutClient needs at least one replica client")
        if names is not None and len(names) != len(replicas):
            raise ValueError(f"FanOutClient: {len(names)} names for {len(replicas)} replicas")
        self.replicas = list(replicas)
        self.names = list(names) if names is not None else [
            str(getattr(r, "base_url", f"replica {i}")) for i, r in enumerate(replicas)
        ]  # fmt: skip
        self.timeout_s = timeout_s
        self.all_or_nothing = all_or_nothing
        self._lock = threading.Lock()  # guards _open and _settling
        self._open: set[int] = set()  # replicas in the round
        self._previous: list[str | None] = [None] * len(self.replicas)  # labels before it
        self._settling: Future[list[str]] | None = None  # a failed update's rollback
        self.control: ControlKey | None = None  # the trainer's key: signs the fleet's controls
        self._round = 0  # counts starts: a rollback still confirming stops when a new one starts

    def bind_control(self, control: ControlKey) -> None:
        """Sign the controls this fleet sends, and key its init payloads, with the
        trainer's key (`RoundClient` binds it)."""
        self.control = control

    def _sign(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload if self.control is None else self.control.sign(payload)

    @classmethod
    def http(cls, urls: Sequence[str], **client_kwargs: Any) -> FanOutClient:
        """A fleet of vLLM API servers, one `HTTPVLLMWeightSyncClient` per URL."""
        return cls([HTTPVLLMWeightSyncClient(url, **client_kwargs) for url in urls])

    @classmethod
    def ray(cls, handles: Sequence[Any], **client_kwargs: Any) -> FanOutClient:
        """A fleet of Ray actors, one `RayVLLMWeightSyncClient` per handle."""
        return cls([RayVLLMWeightSyncClient(h, **client_kwargs) for h in handles])

    # -- fanning out -------------------------------------------------------
    def _fan(
        self, what: str, call: Callable[[int, Any], T], which: Sequence[int]
    ) -> dict[int, Future[T]]:
        calls = {i: functools.partial(call, i, self.replicas[i]) for i in which}
        return {i: in_background(c, name=f"wt-fleet-{what}-{i}") for i, c in calls.items()}

    def _settle(self, futures: dict[int, Future[Any]]) -> dict[int, BaseException]:
        """Wait for every call (bounded); the failures by replica, in replica order."""
        return settle(futures, self.timeout_s)

    def _first(self, futures: dict[int, Future[Any]]) -> tuple[int, BaseException] | None:
        """Wait for every call (bounded); the failure of the first replica that failed."""
        return next(iter(self._settle(futures).items()), None)

    def _each(self, what: str, call: Callable[[int, Any], T]) -> list[T]:
        """Run `call` on every replica; raise the first failure once all are done."""
        futures = self._fan(what, call, self.indexes)
        failed = self._first(futures)
        if failed is not None:
            i, error = failed
            raise WeightSyncRPCError(what, f"replica {i} ({self.names[i]}): {error}") from error
        return [futures[i].result() for i in self.indexes]

    @property
    def indexes(self) -> list[int]:
        return list(range(len(self.replicas)))

    # -- the four calls --------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """The same handshake on every replica; the first failure raises at once."""
        self.init_replicas([init_info] * len(self.replicas))

    def init_replicas(self, payloads: Sequence[dict[str, Any]]) -> None:
        """Replica `i` gets `payloads[i]`. The first failure raises at once (the
        trainer hosting a rendezvous must stop waiting); the rest go on."""
        if len(payloads) != len(self.replicas):
            raise ValueError(f"{len(payloads)} init payloads for {len(self.replicas)} replicas")
        keyed = [with_control_key(p, self.control) for p in payloads]
        futures = self._fan(
            "init", lambda i, r: r.init_weight_transfer_engine(keyed[i]), self.indexes
        )
        failed = first_failure(futures, self.timeout_s)
        if failed is not None:
            i, error = failed
            raise FleetError("init", i, self.names[i], error, []) from error

    def start_weight_update(self) -> None:
        """Start the round on every replica and ask each to hold its commit.

        Waits first for the rollback of a failed round (bounded). Raises
        `FleetError("start", ...)` with every replica back out of the round.
        """
        unrecovered = self._wait_settled()
        self._round += 1
        if unrecovered:
            logger.warning("the last failed round left replicas open: %s", "; ".join(unrecovered))
        if not self.all_or_nothing:
            self._each("start_weight_update", lambda i, r: _start(r, self._sign))
            return
        labels = self._fan("weight_version", lambda i, r: _weight_version(r), self.indexes)
        failed = self._first(labels)
        if failed is not None:  # nothing has started anywhere
            self._fail("start", *failed, unrecovered=[])
        self._previous = [labels[i].result() for i in self.indexes]
        starts = self._fan("start", lambda i, r: _start(r, self._sign), self.indexes)
        failed = self._first(starts)
        with self._lock:
            self._open = set(self.indexes)  # a start whose answer was lost may have opened one
        if failed is None:
            holds = self._fan(
                "hold", lambda i, r: r.update_weights(self._sign({HOLD_FIELD: True})), self.indexes
            )
            failed = self._first(holds)
        if failed is not None:
            # Nothing was loaded yet: a replica that cannot be aborted now serves
            # its previous weights, and its engine rolls the empty round back.
            aborting = self._take_open()
            for failure in self._abort(aborting, "the start phase failed", confirm=False):
                logger.warning("%s (it loaded nothing; its round expires)", failure)
            self._fail("start", *failed, unrecovered=[])

    def update_weights(self, update_info: UpdatePayload) -> None:
        """`update_info` on every replica in the round.

        The first failure raises `FleetError("update", ...)` at once, while the
        other calls settle and every replica is aborted in the background;
        `round_failed` and the next start wait for that rollback.
        """
        if not self.all_or_nothing:
            self._each("update_weights", lambda i, r: r.update_weights(update_info))
            return
        calls = self._fan("update", lambda i, r: r.update_weights(update_info), self._in_round())
        failed = first_failure(calls, self.timeout_s)
        if failed is None:
            return
        aborting = self._take_open()

        def settle_then_abort() -> list[str]:
            self._settle(calls)  # then abort all: a call that failed on the way may have arrived
            return self._abort(aborting, "another replica failed its update")

        with self._lock:
            self._settling = in_background(settle_then_abort, name="wt-fleet-settle")
        i, error = failed
        raise FleetError("update", i, self.names[i], error, [], rolling_back=True) from error

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit on every replica, then resume and release each; or, if any
        failed, revert every replica and raise `FleetError("finish", ...)`."""
        if not self.all_or_nothing:
            self._each("finish_weight_update", lambda i, r: _finish(r, weight_version))
            return
        self._wait_settled()
        which = self._in_round()
        finishes = self._fan("finish", lambda i, r: _finish(r, weight_version), which)
        failures = self._settle(finishes)
        self._take_open()
        finished = set(which) - set(failures)
        failed = next(iter(failures.items()), None)
        if failed is None:
            resumes = self._fan("resume", lambda i, r: _resume(r), sorted(finished))
            for failure in self._failures("resume", resumes):
                logger.warning("%s (resume_generation() resumes it)", failure)
            self._release(finished)
            return
        unsure = set(which) - finished  # a finish whose answer was lost may have committed
        unrecovered = self._revert(finished, required=True) + self._revert(unsure, required=False)
        self._fail("finish", *failed, unrecovered=unrecovered)

    # -- ending rounds ---------------------------------------------------
    def round_failed(self, error: BaseException) -> None:
        """The trainer's round failed: wait for the rollback under way (bounded)
        and abort any replica still in the round. What could not be rolled back
        is added to `error` when it is this fleet's `FleetError`."""
        if not self.all_or_nothing:
            return
        unrecovered = self._wait_settled()
        unrecovered += self._abort(self._take_open(), f"the trainer's round failed: {error}")
        if unrecovered:
            if isinstance(error, FleetError):
                error.add_unrecovered(unrecovered)
            logger.error("replicas not rolled back after %s: %s", error, "; ".join(unrecovered))

    def _in_round(self) -> list[int]:
        with self._lock:
            which = sorted(self._open)
        if not which:
            raise RuntimeError(
                "no replica is in a round (start_weight_update first; a failed round has ended)"
            )
        return which

    def _take_open(self) -> list[int]:
        """The replicas in the round, which from now on is over."""
        with self._lock:
            which, self._open = sorted(self._open), set()
        return which

    def _wait_settled(self) -> list[str]:
        with self._lock:
            settling, self._settling = self._settling, None
        if settling is None:
            return []
        # it waits for the calls, then the aborts (each bounded by timeout_s), then confirms
        bound = 2 * self.timeout_s + min(self.timeout_s, _CONFIRM_WITHIN_S) + PEER_GRACE_S
        try:
            return settling.result(timeout=bound)
        except Exception as e:
            return [f"the rollback did not finish: {e}"]

    def _fail(self, phase: str, i: int, error: BaseException, *, unrecovered: list[str]) -> None:
        raise FleetError(phase, i, self.names[i], error, unrecovered) from error

    def _abort(self, which: Sequence[int], reason: str, *, confirm: bool = True) -> list[str]:
        """Abort the round on `which`; the replicas whose rollback is not confirmed.

        With `confirm`, a replica whose abort failed (no answer: its engine was
        busy, the connection broke) is asked again for up to `_CONFIRM_WITHIN_S`
        (at most `timeout_s`): an abort answered "aborted" or "no round", and its
        previous label read back, confirm it is on its previous weights
        (`_confirm_rolled_back`). Without, every failed abort is listed.
        """
        aborts = self._fan("abort", lambda i, r: _abort(r, reason, self._sign), which)
        failed = self._settle(aborts)
        if not confirm:
            return self._describe("abort", failed)
        if not failed:
            return []
        round_ = self._round
        confirms = self._fan(
            "confirm", lambda i, r: self._confirm_rolled_back(i, r, reason, round_), list(failed)
        )
        return [
            f"abort of replica {i} ({self.names[i]}) failed: {failed[i]}; then {error}"
            for i, error in self._settle(confirms).items()
        ]

    def _confirm_rolled_back(self, i: int, replica: Any, reason: str, round_: int) -> None:
        """Ask replica `i` again (bounded) until its round is confirmed closed and its
        label is the previous one; raise saying what is still unconfirmed. Stops when
        round `round_` is over (a new start must never meet one of these aborts)."""
        deadline = time.monotonic() + min(self.timeout_s, _CONFIRM_WITHIN_S)
        while True:
            if self._round != round_:
                raise RuntimeError("its rollback is not confirmed: a new round started")
            try:
                _abort(replica, reason, self._sign)
                label = _weight_version(replica)
                if label == self._previous[i] or self._previous[i] is None:
                    return
                raise RuntimeError(f"its label is {label!r}, not {self._previous[i]!r}")
            except Exception as error:
                if time.monotonic() + _CONFIRM_PERIOD_S >= deadline:
                    raise RuntimeError(f"its rollback is not confirmed: {error}") from error
            time.sleep(_CONFIRM_PERIOD_S)

    def _revert(self, which: set[int], *, required: bool) -> list[str]:
        """Revert `which` to their held records and labels. Not `required`: a
        replica holding nothing (it never committed) is fine. Generation on
        them is paused (a finish that keeps it paused) and resumed after."""
        accept = () if required else (Refusal.NOTHING_HELD,)

        def revert(i: int, replica: Any) -> None:
            paused = bool(getattr(replica, "resumes_on_request", False))
            payload = {REVERT_FIELD: "another replica failed"}
            _control_round(replica, payload, self._sign, accept, paused=paused)
            _set_weight_version(replica, self._previous[i])

        reverts = self._fan("revert", revert, sorted(which))
        return self._failures("revert", reverts)

    def _release(self, which: set[int]) -> None:
        payload = {RELEASE_FIELD: "every replica finished"}
        releases = self._fan(
            "release", lambda i, r: _control_round(r, payload, self._sign), sorted(which)
        )
        for failure in self._failures("release", releases):
            logger.warning("%s (it keeps its undo record until its next round loads)", failure)

    def _failures(self, what: str, futures: dict[int, Future[Any]]) -> list[str]:
        """Wait for every call (bounded); each failure, naming its replica."""
        return self._describe(what, self._settle(futures))

    def _describe(self, what: str, failures: dict[int, BaseException]) -> list[str]:
        return [f"{what} of replica {i} ({self.names[i]}) failed: {e}" for i, e in failures.items()]

    # -- beyond the round ----------------------------------------------------
    def resume_generation(self) -> None:
        """Resume generation on every replica (after a trainer died mid-round)."""
        self._each("resume_generation", lambda i, r: r.resume_generation())

    def abort_weight_update(self, reason: str = "aborted by the caller") -> None:
        """vLLM's `abort_weight_update` on every replica: the open round rolls back
        everywhere (signed with the trainer's key); raises naming the replicas whose
        rollback is not confirmed."""
        unconfirmed = self._abort(self.indexes, reason)
        if unconfirmed:
            raise RuntimeError("; ".join(unconfirmed))

    def shutdown_weight_transfer_engine(self) -> None:
        """Shut down every replica's engine (each drops its trainer); the first
        failure raises once every replica answered."""
        self._each(
            "shutdown_weight_transfer_engine", lambda i, r: r.shutdown_weight_transfer_engine()
        )

    def weight_versions(self) -> list[str | None]:
        """Every replica's version label (None where its client cannot read it)."""
        return self._each("weight_version", lambda i, r: _weight_version(r))


# -- one replica ---------------------------------------------------------------
Sign = Callable[[dict[str, Any]], dict[str, Any]]


def _start(replica: Any, sign: Sign) -> None:
    """Start a round; one left open there (a trainer that died in it) is aborted first."""
    start_round(replica.start_weight_update, lambda reason: _abort(replica, reason, sign))


def _finish(replica: Any, weight_version: str | None) -> None:
    """Finish; a client that can keeps generation paused until `_resume` (the fleet decides)."""
    if getattr(replica, "resumes_on_request", False):
        replica.finish_weight_update(weight_version, resume=False)
    else:
        finish_round(replica.finish_weight_update, weight_version)


def _resume(replica: Any) -> None:
    if getattr(replica, "resumes_on_request", False):
        replica.resume_generation()


def _abort(replica: Any, reason: str, sign: Sign) -> None:
    """End the replica's round, rolling it back; a round already closed is fine."""
    abort_round(replica.update_weights, reason, sign)


def _control_round(
    replica: Any,
    payload: dict[str, Any],
    sign: Sign,
    accept: Sequence[Refusal] = (),
    *,
    paused: bool = False,
) -> None:
    """A round that carries one in-band control and loads nothing
    (`weight_transfer.runtime.control.control_round`), through the replica's own
    `control_round` where it has one (it pauses generation around a revert).
    `paused`: the replica's generation is paused already (the client resumes it)."""
    run = getattr(replica, "control_round", None)
    if callable(run):
        run(payload, accept, paused=paused, sign=sign)
        return
    control_round(
        replica.start_weight_update,
        replica.update_weights,
        replica.finish_weight_update,
        payload,
        sign,
        accept,
    )


def _weight_version(replica: Any) -> str | None:
    """The replica's label: a client's `weight_version()`, a session's attribute."""
    label = getattr(replica, "weight_version", None)
    if callable(label):
        label = label()
    return None if label is None else str(label)


def _set_weight_version(replica: Any, version: str | None) -> None:
    write = getattr(replica, "set_weight_version", None)
    if version is not None and callable(write):
        write(version)
