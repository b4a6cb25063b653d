"""The stacks a failed test's report carries (`tests/stacks.py`)."""

from __future__ import annotations

import select
import subprocess
import sys
import time

import pytest

from tests.stacks import py_spy, stacks_of_this_run

CHILD = """
import time

def waiting_in_a_known_place():
    print("ready", flush=True)
    time.sleep(60)

waiting_in_a_known_place()
"""


@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed")
def test_the_stacks_name_where_each_process_of_the_run_waits() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert select.select([child.stdout], [], [], 30)[0], "the child did not start in 30 s"
        assert child.stdout.readline() == b"ready\n"
        time.sleep(0.2)  # in its sleep
        text = stacks_of_this_run()
    finally:
        child.kill()
        child.wait(10)
    assert f"--- pid {child.pid}:" in text
    assert "waiting_in_a_known_place" in text
    assert "test_the_stacks_name_where_each_process_of_the_run_waits" in text  # this process
