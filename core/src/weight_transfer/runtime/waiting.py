"""Running control-plane calls beside a transfer, without ever joining them on error.

`in_background(fn)` runs `fn` on a daemon thread and returns a
`concurrent.futures.Future`. Daemon threads are never joined: when a transfer
fails, a worker still blocked in the matching RPC cannot hold the trainer (or
the interpreter's exit) hostage.

`wait_for(futures, timeout_s)` waits until all are done and raises the first
failure at once, labelled with its name. For calls fanned out to several
peers (a fleet's replicas), `settle` waits for all of them and returns every
failure, and `first_failure` returns as soon as one fails; both count a call
still running at the bound as failed.

Collectives are watched by polling (`work_future`, `wait_work`), never through
a callback on the library's own future or a blocking wait on a helper thread:
either makes a library thread (or a blocked one) take the interpreter lock
when the collective ends, and a collective that ends while the interpreter
exits (one kept alive after an abort, say) then aborts the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "in_background",
    "wait_for",
    "await_transfer",
    "work_future",
    "wait_work",
    "TransferTimeout",
    "CollectiveError",
    "PEER_GRACE_S",
    "all_settle",
    "settle",
    "first_failure",
]

# How long an in-flight collective may still take after a peer has answered: a
# worker that drained the round and then failed answers at about the moment the
# trainer's last broadcast completes, and either event can be seen first.
PEER_GRACE_S = 2.0

T = TypeVar("T")
K = TypeVar("K")


class TransferTimeout(TimeoutError):
    """A bounded wait ran out; the message names what was pending."""


def in_background(fn: Callable[[], T], *, name: str) -> Future[T]:
    """Start `fn()` on a daemon thread named `name`; its result lands in the future."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the network broke, or it timed out."""


def _collective_error(what: str, error: BaseException) -> CollectiveError:
    failed = CollectiveError(
        f"{what} failed (a peer process died, the network broke or it timed out): {error}"
    )
    failed.__cause__ = error
    return failed


_POLL_S = 0.001  # how often pending collectives are looked at


class _WorkPoller:
    """One daemon thread that completes the futures of `work_future` by polling."""

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work, Future[None], str]] = []
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, work: dist.Work, future: Future[None], what: str) -> None:
        with self._ready:
            self._pending.append((work, future, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wt-work-poll", daemon=True)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._pending:
                    self._ready.wait()
                pending = list(self._pending)
            done = [item for item in pending if _ended(item[0])]
            for work, future, what in done:
                try:
                    work.wait()  # it has ended: returns at once, or raises its error
                    future.set_result(None)
                except BaseException as e:
                    future.set_exception(_collective_error(what, e))
            with self._ready:
                self._pending = [item for item in self._pending if item not in done]
            if len(done) < len(pending):
                time.sleep(_POLL_S)


def _ended(work: dist.Work) -> bool:
    """Whether `work` has ended; a work that cannot say counts as ended (its `wait` tells)."""
    try:
        return bool(work.is_completed())
    except Exception:
        return True


_POLLER = _WorkPoller()


def work_future(work: dist.Work, what: str = "a collective") -> Future[None]:
    """A `concurrent.futures.Future` that completes with a collective's `work`
    (within about a millisecond; see the module doc).

    A failure becomes `CollectiveError` naming `what`, chained to the library's error.
    """
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()
    _POLLER.add(work, future, what)
    return future


def wait_work(
    work: dist.Work,
    what: str,
    deadline: float,
    *,
    check: Callable[[], None] | None = None,
    check_every_s: float = 0.5,
) -> None:
    """Wait on this thread until `work` ends, polling (see the module doc).

    `check()` runs every `check_every_s` while waiting (it raises to stop the
    wait). Raises `TransferTimeout` naming `what` at `deadline` (monotonic
    seconds), `CollectiveError` when the collective failed.
    """
    pause = 5e-5
    next_check = time.monotonic() + check_every_s
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise TransferTimeout(f"{what} did not complete in time")
        if check is not None and now >= next_check:
            check()
            next_check = now + check_every_s
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)
    try:
        work.wait()
    except Exception as e:
        raise _collective_error(what, e) from e


def wait_for(futures: Mapping[str, Future[Any]], timeout_s: float) -> dict[str, Any]:
    """Results of all `futures` by name; the first failure or a timeout raises at once."""
    done, pending = wait(list(futures.values()), timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for fut in futures.values():
        error = fut.exception() if fut in done else None
        if error is not None:
            raise error
    if pending:
        waiting = [name for name, fut in futures.items() if fut in pending]
        raise TransferTimeout(f"timed out after {timeout_s:g}s waiting for {', '.join(waiting)}")
    return {name: fut.result() for name, fut in futures.items()}


def await_transfer(
    target: Future[T], *, watch: Mapping[str, Future[Any]], timeout_s: float, what: str
) -> T:
    """Wait for `target` while watching control-plane futures.

    Returns `target`'s result (also when a watched future failed meanwhile).
    Raises at once when a watched future fails (its
    own exception: e.g. the worker's error from `update_weights`), when
    `target` fails, or `TransferTimeout` naming `what` after `timeout_s`.
    A watched future that completes successfully stops being watched.
    """
    watching = dict(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"{what} did not complete within {timeout_s:g}s")
        done, _ = wait([target, *watching.values()], timeout=remaining, return_when=FIRST_COMPLETED)
        if target in done:
            return target.result()
        for name, fut in list(watching.items()):
            if fut in done:
                error = fut.exception()
                if error is not None:
                    raise error
                del watching[name]


def all_settle(futures: Iterable[Future[Any]], within_s: float = PEER_GRACE_S) -> bool:
    """Whether every future completes successfully within `within_s` in total.

    After a failure, a group whose in-flight collectives all complete is still
    aligned and can carry the next round.
    """
    deadline = time.monotonic() + within_s
    for fut in futures:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            return False
    return True


def _failure(future: Future[Any], timeout_s: float) -> BaseException | None:
    if not future.done():
        return TimeoutError(f"no answer within {timeout_s:g}s")
    return future.exception()


def settle(futures: Mapping[K, Future[Any]], timeout_s: float) -> dict[K, BaseException]:
    """Wait for every call, at most `timeout_s`; the failures by key, in `futures`'
    order (a call still running then fails with `TimeoutError`)."""
    wait(list(futures.values()), timeout=timeout_s)
    failures = {key: _failure(future, timeout_s) for key, future in futures.items()}
    return {key: error for key, error in failures.items() if error is not None}


def first_failure(
    futures: Mapping[K, Future[Any]], timeout_s: float
) -> tuple[K, BaseException] | None:
    """Wait until every call succeeded (None) or one failed (at most `timeout_s`): the
    first failure in `futures`' order among the calls done, else a call still running."""
    wait(list(futures.values()), timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for key, future in futures.items():
        error = future.exception() if future.done() else None
        if error is not None:
            return key, error
    running = next((key for key, future in futures.items() if not future.done()), None)
    if running is None:
        return None
    return running, TimeoutError(f"no answer within {timeout_s:g}s")
