"""Bounded waits beside a transfer: `await_transfer`, `wait_for`, `in_background`,
and the fan-out waits `settle` and `first_failure`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from weight_transfer.runtime.waiting import (
    TransferTimeout,
    await_transfer,
    first_failure,
    in_background,
    settle,
    wait_for,
)


def _failed(error: BaseException) -> Future[None]:
    f: Future[None] = Future()
    f.set_exception(error)
    return f


def _done(value: object = None) -> Future[object]:
    f: Future[object] = Future()
    f.set_result(value)
    return f


def test_watched_failure_raises_at_once_while_the_transfer_hangs() -> None:
    never: Future[None] = Future()
    late: Future[None] = Future()
    threading.Timer(0.1, lambda: late.set_exception(ValueError("worker 1: bad name"))).start()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="worker 1: bad name"):
        await_transfer(never, watch={"update_weights": late}, timeout_s=30, what="bucket 3")
    assert time.monotonic() - t0 < 5


def test_timeout_names_what_was_pending() -> None:
    never: Future[None] = Future()
    t0 = time.monotonic()
    with pytest.raises(
        TransferTimeout, match=r"^broadcast of bucket 7/9 did not complete within 0.2s$"
    ):
        await_transfer(never, watch={"rpc": _done()}, timeout_s=0.2, what="broadcast of bucket 7/9")
    assert 0.15 < time.monotonic() - t0 < 5
    assert issubclass(TransferTimeout, TimeoutError)


def test_result_after_a_watched_success_and_target_failure() -> None:
    target: Future[object] = Future()
    threading.Timer(0.1, lambda: target.set_result(42)).start()
    assert await_transfer(target, watch={"rpc": _done()}, timeout_s=10, what="x") == 42
    with pytest.raises(OSError, match="link down"):
        await_transfer(_failed(OSError("link down")), watch={}, timeout_s=10, what="x")


def test_wait_for_results_first_failure_and_timeout() -> None:
    assert wait_for({"a": _done(1), "b": _done(2)}, 1) == {"a": 1, "b": 2}
    never: Future[None] = Future()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rendezvous refused"):
        wait_for({"hang": never, "bad": _failed(RuntimeError("rendezvous refused"))}, 30)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TransferTimeout, match=r"timed out after 0.1s waiting for the rendezvous$"):
        wait_for({"init": _done(), "the rendezvous": never}, 0.1)


def test_settle_waits_for_every_call_and_returns_each_failure_in_order() -> None:
    late: Future[object] = Future()
    threading.Timer(0.1, lambda: late.set_exception(KeyError("late"))).start()
    never: Future[object] = Future()
    calls = {2: _failed(ValueError("two")), 0: late, 1: _done(1), 3: never}
    t0 = time.monotonic()
    failures = settle(calls, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5  # it waited for the call that never ends
    assert list(failures) == [2, 0, 3]
    assert isinstance(failures[0], KeyError) and isinstance(failures[2], ValueError)
    assert isinstance(failures[3], TimeoutError) and "1s" in str(failures[3])
    assert settle({0: _done(), 1: _done()}, timeout_s=1.0) == {}


def test_first_failure_returns_at_the_first_failure_or_names_a_call_still_running() -> None:
    never: Future[object] = Future()
    late: Future[object] = Future()
    threading.Timer(0.1, lambda: late.set_exception(ValueError("refused"))).start()
    t0 = time.monotonic()
    key, error = first_failure({0: never, 1: late, 2: _done()}, timeout_s=30) or (None, None)
    assert time.monotonic() - t0 < 5  # at once, not after the bound
    assert key == 1 and isinstance(error, ValueError)
    key, error = first_failure({0: _done(), 1: never}, timeout_s=0.2) or (None, None)
    assert key == 1 and isinstance(error, TimeoutError)
    assert first_failure({0: _done(), 1: _done()}, timeout_s=1.0) is None


def test_in_background_runs_on_a_named_daemon_thread() -> None:
    seen: dict[str, object] = {}

    def work() -> int:
        t = threading.current_thread()
        seen.update(name=t.name, daemon=t.daemon)
        return 7

    assert in_background(work, name="wt-probe").result(timeout=10) == 7
    assert seen == {"name": "wt-probe", "daemon": True}

    def boom() -> None:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        in_background(boom, name="wt-boom").result(timeout=10)


def test_work_future_completes_with_a_real_gloo_collective() -> None:
    import torch
    import torch.distributed as dist

    from weight_transfer.runtime.waiting import work_future

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    t = torch.arange(5.0)
    fut = work_future(pg.allreduce([t]))
    assert fut.result(timeout=30) is None
    assert torch.equal(t, torch.arange(5.0))
    assert await_transfer(work_future(pg.broadcast([t])), watch={}, timeout_s=30, what="b") is None
