"""Fixtures for the wt-core tests.

- `isolated_registries` (autouse): in-process registrations and resolved
  classes of both factories are restored after every test.
- `make_dist`: writes a throw-away installed distribution (a `*.dist-info`
  directory with METADATA and entry_points.txt, plus its modules) into a
  temporary folder and puts that folder on `sys.path` for the test.
- `fresh_hooks`: the hook manager is rebuilt for the test and restored after.
- `unique`: a per-test token for module and backend names that must not clash.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory


@pytest.fixture(autouse=True)
def isolated_registries() -> Iterator[None]:
    saved = [
        (r, dict(r._registered), dict(r._resolved))
        for r in (WeightTransferTrainerFactory.registry, WeightTransferEngineFactory.registry)
    ]
    yield
    for registry, registered, resolved in saved:
        registry._registered.clear()
        registry._registered.update(registered)
        registry._resolved.clear()
        registry._resolved.update(resolved)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:10]


MakeDist = Callable[..., Path]


@pytest.fixture
def make_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDist]:
    """`make_dist(name, version, entry_points={group: {ep: value}}, modules={mod: source})`."""
    created: list[str] = []

    def make(
        name: str,
        version: str,
        *,
        entry_points: dict[str, dict[str, str]],
        modules: dict[str, str],
    ) -> Path:
        root = tmp_path / f"site-{name}"
        root.mkdir()
        for module, source in modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            created.append(module)
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines: list[str] = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines.extend(f"{ep} = {value}" for ep, value in eps.items())
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))
        monkeypatch.syspath_prepend(str(root))
        return root

    yield make
    for module in created:
        sys.modules.pop(module, None)


@pytest.fixture
def fresh_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    from weight_transfer.runtime import hooks

    monkeypatch.setattr(hooks, "_manager", None)
