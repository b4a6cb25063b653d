"""Running control-plane calls beside a transfer, without ever joining them on error.

`in_background(fn)` runs `fn` on a daemon thread and returns a
`concurrent.futures.Future`. Daemon threads are never joined: when a transfer
fails, a worker still blocked in the matching RPC cannot hold the trainer (or
the interpreter's exit) hostage.

`wait_for(futures, timeout_s)` waits until all are done and raises the first
failure at once, labelled with its name.
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
    "TransferTimeout",
    "CollectiveError",
    "PEER_GRACE_S",
    "all_settle",
]

# How long an in-flight collective may still take after a peer has answered: a
# worker that drained the round and then failed answers at about the moment the
# trainer's last broadcast completes, and either event can be seen first.
PEER_GRACE_S = 2.0

T = TypeVar("T")


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


def work_future(work: dist.Work, what: str = "a collective") -> Future[None]:
    """A `concurrent.futures.Future` that completes with a collective's `work`.

    A failure becomes `CollectiveError` naming `what`, chained to the library's error.
    """
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()

    def done(fut: Any) -> None:
        try:
            fut.wait()
            future.set_result(None)
        except BaseException as e:
            error = CollectiveError(
                f"{what} failed (a peer process died, the network broke or it timed out): {e}"
            )
            error.__cause__ = e
            future.set_exception(error)

    work.get_future().add_done_callback(done)
    return future


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
