"""A test that outlives its timeout: the stacks of every process of the run,
then those processes stopped, then this one.

pytest-timeout's `thread` method (the suite's, `pyproject.toml`) prints this
process's threads and exits it at once, with no fixture teardown: the live
servers, trainer subprocesses and Ray clusters the run started were left
running (they loaded the machine for whatever ran next), and the other end of
a hang went unseen. This plugin takes over that method's timer
(`pytest_timeout_set_timer`). At expiry it writes one `py-spy dump` of this
process and each of its descendants (`tests.stacks`; this process's threads
through `faulthandler` where py-spy is missing) to the worker's stderr, kills
each descendant by PID (SIGKILL), and exits the worker with status 1, as the
`thread` method does. pytest-timeout's `signal` method is left to it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from typing import Any

import pytest

from tests.stacks import py_spy, stacks_of_this_run

__all__ = ["pytest_timeout_set_timer", "stop_descendants"]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    if settings.method != "thread":
        return None
    timer = threading.Timer(settings.timeout, _expired, (item, settings))
    timer.name = f"wt-timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:  # called by pytest-timeout's `pytest_timeout_cancel_timer`
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  (pytest-timeout reads it)
    timer.start()
    return True


def stop_descendants() -> list[int]:
    """SIGKILL every descendant of this process, deepest first; their PIDs."""
    import psutil

    descendants = psutil.Process().children(recursive=True)
    for process in reversed(descendants):
        with contextlib.suppress(psutil.Error):  # it ended meanwhile
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(descendants, timeout=10)
    return [process.pid for process in descendants]


def _expired(item: pytest.Item, settings: Any) -> None:
    from pytest_timeout import is_debugging

    if not settings.disable_debugger_detection and is_debugging():
        return
    try:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(item)  # fd 2 is the worker's stderr again
        _say(f"\n{'+' * 30} Timeout (>{settings.timeout:g}s): {item.nodeid} {'+' * 30}\n")
        if py_spy() is None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _say(stacks_of_this_run() + "\n")
        _say(f"stopped the run's processes: {stop_descendants()}\n")
    finally:
        sys.stderr.flush()
        os._exit(1)


def _say(text: str) -> None:
    data = text.encode(errors="replace")
    while data:
        data = data[os.write(2, data) :]
