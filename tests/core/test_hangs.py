"""A test past its timeout (`tests/hangs.py`): every process's stacks, then the
run's processes stopped, then its worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.core.test_stacks import CHILD
from tests.stacks import py_spy

psutil = pytest.importorskip("psutil")
REPO = Path(__file__).resolve().parents[2]

HUNG_TEST = f"""
import subprocess, sys, time

CHILD = {CHILD!r}

def test_that_hangs():
    child = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
    with open("child.pid", "w") as f:
        f.write(str(child.pid))
    time.sleep(120)
"""


@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed")
def test_a_hung_test_shows_every_process_and_stops_the_ones_it_started(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG_TEST))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.hangs",
         "--timeout", "5", "-o", "timeout_method=thread", "test_hung.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    child = int((tmp_path / "child.pid").read_text())
    assert done.returncode == 1, output
    assert "Timeout (>5s): test_hung.py::test_that_hangs" in output, output
    assert f"--- pid {child}:" in output and "waiting_in_a_known_place" in output, output
    assert "test_that_hangs" in output  # the hung process's own stack
    assert f"stopped the run's processes: [{child}]" in output, output
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
