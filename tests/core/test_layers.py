"""The import graph of every first-party package: no cycles, no upward imports.

Imports are read from the source (`ast`), at module level and inside
functions alike, so a lazy import that closes a cycle counts too. wt-core's
layers, lowest first: the contract (what every backend reads), the kits
(`weight_transfer.kits`: optional helpers built on the contract), and the
entry points (the package's facade, the clients, the fleet, the factories,
the CLI, the vLLM plugin, the conformance suite `weight_transfer.testing`). A
module imports only from its own layer or below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "core/src/weight_transfer",
    *sorted((ROOT / "plugins").glob("*/src/wt_*")),
    ROOT / "examples/wt-example/src/wt_example",
    ROOT / "tools/src/wt_tools",
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
    "weight_transfer.vllm",
    "weight_transfer.vllm.engines",
    "weight_transfer.vllm.plugin",
}


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


def _layer(module: str) -> int:
    if module in ENTRY_POINTS or not module.startswith("weight_transfer"):
        return 2
    if module.startswith("weight_transfer.testing"):  # drives backends through the factories
        return 2
    return 1 if module.startswith("weight_transfer.kits") else 0


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
    assert "weight_transfer.control" in GRAPH["weight_transfer.base"]
    assert "weight_transfer.backend" in GRAPH["wt_nccl.worker"]
    assert len(MODULES) > 60


def test_no_import_cycle() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("weight_transfer")))
def test_no_upward_import(module: str) -> None:
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert upward == [], f"{module} (layer {_layer(module)}) imports from above: {upward}"
