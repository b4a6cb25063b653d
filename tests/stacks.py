"""On a failed test, the Python stacks of every process the test run started.

A failure under load that does not happen alone (a broadcast that neither end
saw complete, an RPC that reached a worker late) is found from where each
process was waiting when it failed, not from a rerun. When a test fails, this
plugin takes one `py-spy dump` of this process and of each of its descendants
(live vLLM servers with their engine cores and workers, trainer subprocesses,
Ray's workers) and adds them to the test's report as the section
`stacks of the run's processes`, which pytest prints with the failure.

Where `py-spy` (or `psutil`) is not installed, or may not attach (it needs
ptrace rights over the processes), the section says so instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

SECTION = "stacks of the run's processes"
MAX_PROCESSES = 40
DUMP_TIMEOUT_S = 20.0
MAX_CHARS = 200_000


def py_spy() -> str | None:
    """The `py-spy` beside this interpreter (the tests' venv), else on `PATH`."""
    return shutil.which(
        "py-spy",
        path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    )


def stacks_of_this_run() -> str:
    """One `py-spy dump` of this process and each of its descendants, as text."""
    spy = py_spy()
    if spy is None:
        return "py-spy is not installed: no stacks taken"
    try:
        import psutil
    except ImportError:
        return "psutil is not installed: no stacks taken"

    me = psutil.Process()
    processes = [me, *me.children(recursive=True)][:MAX_PROCESSES]
    parts = []
    for process in processes:
        try:
            title = " ".join(process.cmdline())[:200] or process.name()
        except psutil.Error:
            continue  # it ended meanwhile
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(process.pid)],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
            )
            stacks = (done.stdout + done.stderr).strip()
        except subprocess.TimeoutExpired:
            stacks = f"py-spy took over {DUMP_TIMEOUT_S:g}s"
        parts.append(f"--- pid {process.pid}: {title}\n{stacks}")
    text = "\n".join(parts)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "\n[cut]"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.failed and call.when == "call":
        report.sections.append((SECTION, stacks_of_this_run()))
    return report
