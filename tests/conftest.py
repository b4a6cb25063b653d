"""How the suite is split across `pytest -n 2 --dist loadgroup` (`nox -s tests`).

Tests that share something expensive run in one worker process, each group as
a unit: `vllm` (the in-process engines and the live HTTP servers that
`tests/vllm` shares) and `ray` (the tests that start a local Ray cluster). Every
other test, and every extended check, goes to whichever worker is free. Without
xdist the marks do nothing. A failed test's report carries the stacks of every
process the run started (`tests/stacks.py`); a test past its timeout writes
them and stops those processes before its worker exits (`tests/hangs.py`).
Ray is held to loopback before any test module imports it (vLLM does, at
import), whichever modules run; the `ray` group's modules share one loopback
cluster (`ray_cluster`: one start, not one per module, each about 8 s).
vLLM's CPU workers are left unbound (`VLLM_CPU_OMP_THREADS_BIND=nobind`)
unless a test binds them: bound automatically, every one-worker engine of
the run lands on core 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wt_tools.local_ray import set_loopback_env

from tests.hangs import pytest_timeout_set_timer  # noqa: F401  (a hung test's stacks, cleanup)
from tests.stacks import pytest_runtest_makereport  # noqa: F401  (a failed test's stacks)

set_loopback_env()
# vLLM-cpu binds a worker's OpenMP threads itself ("auto"): every one-worker engine the
# tests start (API servers, engines in Ray actors) went to core 0, so two live
# servers shared one core while the other served the rest of the run, and a server's
# worker starved behind its neighbour: rounds and requests waited 10 to 100 s. Unbound,
# the OS places them; a test that needs a binding (tensor parallel) sets it.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

HERE = Path(__file__).parent
RAY = {
    "tests/vllm/test_ray.py",
    "tests/vllm/test_sharded_rdt_vllm.py",
    "tests/backends/sharded_rdt/test_sharded_nixl.py",
    "tests/gpu/test_sharded_rdt_gpu.py",
}


# The extended checks that run one after another on one worker: the bench, then the
# tensor-parallel server (`tests/vllm/test_bench.py`, `tests/vllm/test_http.py`).
BENCH_WORKER = pytest.mark.xdist_group("bench")


def _group(path: Path) -> str | None:
    relative = path.relative_to(HERE.parent).as_posix()
    if relative in RAY:
        return "ray"
    if relative.startswith("tests/vllm/"):
        return "vllm"
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each item as it is collected, before xdist reads the marks into its groups.
    The extended checks share no engine (each starts what it runs), so they are left
    to whichever worker is free, but for the tensor-parallel server's check, which runs
    after the bench on the bench's worker (`BENCH_WORKER`, marked in the two modules)."""
    group = _group(item.path)
    if group is not None and item.get_closest_marker("extended") is None:
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """The `ray` module, connected to one loopback cluster for the session
    (`tests/backends/sharded_rdt/ray_parts.py`); every module of the `ray` group uses it.
    A test kills the actors it starts."""
    pytest.importorskip("ray")
    from tests.backends.sharded_rdt.ray_parts import ray_cluster as loopback_cluster

    with loopback_cluster() as ray:
        yield ray
