"""docs/writing-a-backend.md works as written: its blocks build a wheel that
`wt backends` lists and that moves weights bit-exactly through a `WorkerSession`.
(A live vLLM using it: tests/vllm/test_spec_example_vllm.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.writing_a_backend import doc_files, install_from_doc


def _run(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=180, check=False
    )


def test_the_page_names_every_file_of_the_backend() -> None:
    assert set(doc_files()) == {
        "pyproject.toml",
        "src/wt_lite/worker.py",
        "src/wt_lite/trainer.py",
        "run_outside_vllm.py",
        "use_in_vllm.py",
    }


def test_the_documented_backend_installs_lists_and_syncs(tmp_path: Path) -> None:
    site = install_from_doc(tmp_path)
    assert (site / "wt_lite-0.1.0.dist-info" / "entry_points.txt").exists()
    listed = _run(site, "-m", "weight_transfer.cli", "backends")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith("lite "))
    assert line.split()[1:] == ["wt-lite", "0.1.0", "wt-lite", "0.1.0"]

    run = _run(site, str(site / "run_outside_vllm.py"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("lite: 4 rounds bit-exact, a second trainer refused")
