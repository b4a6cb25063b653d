"""docs/writing-a-backend.md works as written: its blocks build a wheel that
`wt backends` lists and that moves weights bit-exactly through a `WorkerSession`.
(A live vLLM using it: tests/vllm/test_spec_example_vllm.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.writing_a_backend import DOC, doc_files, install_from_doc


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
        "src/wt_lite/conformance.py",
        "run_outside_vllm.py",
        "use_in_vllm.py",
    }


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_from_doc(tmp_path_factory.mktemp("wt-lite"))


def test_the_documented_backend_installs_lists_and_syncs(site: Path) -> None:
    assert (site / "wt_lite-0.1.0.dist-info" / "entry_points.txt").exists()
    listed = _run(site, "-m", "weight_transfer.cli", "backends")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith("lite "))
    assert line.split()[1:] == ["wt-lite", "0.1.0", "wt-lite", "0.1.0"]

    run = _run(site, str(site / "run_outside_vllm.py"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("lite: 4 rounds bit-exact, a second trainer refused")


def test_the_documented_backend_passes_the_conformance_suite_with_the_documented_line(
    site: Path, tmp_path: Path
) -> None:
    lines = DOC.read_text().splitlines()
    line = next(line for line in lines if line.startswith("pytest -p weight_transfer"))
    args = [*line.split()[1:], "-q", "-p", "no:cacheprovider", "--timeout", "300"]
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    from weight_transfer.testing import conformance

    tests = sum(name.startswith("test_") for name in vars(conformance))
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert summary.startswith(f"{tests} passed"), summary  # every test, on wt-lite alone
