"""The import graph of every first-party package: no cycles, no upward imports.

Imports are read from the source (`ast`), at module level and inside
functions alike, so a lazy import that closes a cycle counts too. wt-core's
layers, lowest first: the core (the contract, `CONTRACT`, which every backend
author reads, and the runtime that keeps it, `weight_transfer.runtime`), the
kits (wt-kits, `wt_kits`: optional helpers built on the core), and the
entry points (the package's facade, the clients, the fleet, the factories,
the CLI, the vLLM bridge `weight_transfer.vllm`, the conformance suite
`weight_transfer.testing`). A module imports only from its own layer or below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "core/src/weight_transfer",
    ROOT / "kits/src/wt_kits",
    *sorted((ROOT / "plugins").glob("*/src/wt_*")),
    ROOT / "examples/wt-example/src/wt_example",
    ROOT / "tools/src/wt_tools",
    *sorted((ROOT / "integrations").glob("*/src/wt_*")),
]
ENTRY_POINTS = {
    "weight_transfer",
    "weight_transfer.backend",
    "weight_transfer.cli",
    "weight_transfer.clients",
    "weight_transfer.factory",
    "weight_transfer.fleet",
    "weight_transfer.registry",
    "weight_transfer.session",
}
# What a backend author reads: the contract's classes, the round on both sides, the payload
# and dtype codecs, the loader protocol, the worker's position.
CONTRACT = {
    "weight_transfer.base",
    "weight_transfer.source",
    "weight_transfer.rounds",
    "weight_transfer.resync",
    "weight_transfer.loading",
    "weight_transfer.payload",
    "weight_transfer.position",
}
# Above: entry points, and the packages loaded only by their host or their test runner.
UPPER_PACKAGES = ("weight_transfer.vllm", "weight_transfer.testing")
# What a backend (a plugin, the example) may import of wt-core: the contract and the kits;
# its conformance profile (`<backend>.conformance`) also the conformance suite's profile.
BACKEND_SURFACE = ("weight_transfer.backend", "wt_kits")
BACKEND_TEST_SEAMS = ("weight_transfer.testing.profile",)
BACKENDS = [
    *sorted((ROOT / "plugins").glob("*/src/wt_*")),
    ROOT / "examples/wt-example/src/wt_example",
]


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                yield name


GRAPH = {name: set(_imports(path)) - {name} for name, path in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int:
    if _within(module, "wt_kits"):
        return 1
    if module in ENTRY_POINTS or not module.startswith("weight_transfer"):
        return 2
    if any(_within(module, package) for package in UPPER_PACKAGES):
        return 2
    return 0


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_is_read() -> None:
    """The reader sees real edges (a broken reader would pass every rule below)."""
    assert "weight_transfer.runtime.control" in GRAPH["weight_transfer.base"]
    assert "weight_transfer.backend" in GRAPH["wt_nccl.worker"]
    assert len(MODULES) > 60


def test_no_import_cycle() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("weight_transfer")))
def test_no_upward_import(module: str) -> None:
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert upward == [], f"{module} (layer {_layer(module)}) imports from above: {upward}"


def test_the_core_is_the_contract_and_its_runtime() -> None:
    """Every core module is either the contract a backend author reads (small: at
    most 8 modules and 2,000 lines) or the runtime that keeps it."""
    core = {m for m in MODULES if m.startswith("weight_transfer") and _layer(m) == 0}
    runtime = {m for m in core if _within(m, "weight_transfer.runtime")}
    assert core - runtime == CONTRACT
    lines = sum(len(MODULES[m].read_text().splitlines()) for m in CONTRACT)
    assert len(CONTRACT) <= 8 and lines <= 2000, (len(CONTRACT), lines)


BACKEND_MODULES = sorted(
    name for name, path in MODULES.items() if any(path.is_relative_to(b) for b in BACKENDS)
)


@pytest.mark.parametrize("module", BACKEND_MODULES)
def test_a_backend_imports_only_the_contract_and_the_kits(module: str) -> None:
    """One authoring surface: no backend reaches into wt-core's runtime, its vLLM
    bridge or any other module outside `weight_transfer.backend` and the kits."""
    allowed = BACKEND_SURFACE + (BACKEND_TEST_SEAMS if module.endswith(".conformance") else ())
    outside = sorted(
        t
        for t in GRAPH[module]
        if t.startswith("weight_transfer") and not any(_within(t, a) for a in allowed)
    )
    assert outside == [], f"{module} imports wt-core's {outside}"
