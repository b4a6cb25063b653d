"""How the suite is split across `pytest -n 2 --dist loadgroup` (`nox -s tests`).

Tests that share something expensive run in one worker process, each group as
a unit: `vllm` (the in-process engines and the live HTTP servers that
`tests/vllm` shares) and `ray` (the tests that start a local Ray cluster). Every
other test goes to whichever worker is free, the demo's and the bench's too
(they run the tools in processes of their own). Without xdist the marks do
nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
RAY = {
    "tests/vllm/test_ray.py",
    "tests/vllm/test_sharded_rdt_vllm.py",
    "tests/backends/sharded_rdt/test_sharded_nixl.py",
    "tests/gpu/test_sharded_rdt_gpu.py",
}


# Tests under tests/vllm that run the tools in processes of their own and share nothing
# with the group: they go to whichever worker is free (the extended run's two run at once).
OWN_PROCESSES = {
    "tests/vllm/test_demo.py",
    "tests/vllm/test_bench.py",
}


def _group(path: Path) -> str | None:
    relative = path.relative_to(HERE.parent).as_posix()
    if relative in RAY:
        return "ray"
    if relative.startswith("tests/vllm/") and relative not in OWN_PROCESSES:
        return "vllm"
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each item as it is collected, before xdist reads the marks into its groups."""
    group = _group(item.path)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))
