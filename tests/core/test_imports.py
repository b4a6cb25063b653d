"""Importing the package stays light: no httpx, ray or vllm until a piece needs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import weight_transfer


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_does_not_pull_httpx_ray_or_vllm() -> None:
    proc = _fresh(
        "import weight_transfer, sys\n"
        "heavy = {'httpx', 'ray', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "from weight_transfer import list_backends\n"
        "list_backends()\n"
        "heavy = {'httpx', 'ray', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert 'wt_example' not in sys.modules\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_http_client_imports_httpx_when_created() -> None:
    proc = _fresh(
        "import sys\n"
        "from weight_transfer import HTTPVLLMWeightSyncClient\n"
        "assert 'httpx' not in sys.modules\n"
        "HTTPVLLMWeightSyncClient('http://127.0.0.1:9')\n"
        "assert 'httpx' in sys.modules and 'ray' not in sys.modules\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_public_api() -> None:
    expected = {
        "ParamMeta", "WeightSource", "ModuleSource", "layerwise_groups", "VLLMWeightSyncClient",
        "HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient", "LocalVLLMWeightSyncClient",
        "TrainerInitInfo", "TrainerWeightTransferEngine", "WeightTransferTrainerFactory",
        "WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo",
        "WeightTransferInitRequest", "WeightTransferUpdateRequest", "WeightTransferConfig",
        "WeightTransferEngineFactory",
    }  # fmt: skip
    assert expected <= set(weight_transfer.__all__)
    for name in weight_transfer.__all__:
        assert getattr(weight_transfer, name) is not None


def test_core_imports_no_plugin_and_holds_no_application() -> None:
    """No backend is imported by wt-core (the conformance suite's fault injection uses wt-kits)."""
    proc = _fresh(
        "import importlib, pkgutil, sys, weight_transfer as wt\n"
        "names = [m.name for m in pkgutil.walk_packages(wt.__path__, 'weight_transfer.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "plugins = [m for m in sys.modules if m.startswith('wt_') and m[:7] != 'wt_kits']\n"
        "print(sorted(plugins))\n"
        "apps = ('demo', 'bench', 'tiny_model')\n"
        "print(sorted(n for n in names if n.rsplit('.', 1)[-1] in apps))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "[]"]


def test_backend_module_is_the_contract() -> None:
    """`weight_transfer.backend` is the contract (<= 45 names: what the first-party
    backends use of wt-core besides the kits); backends import nothing above it."""
    from tests.core.test_layers import ENTRY_POINTS
    from weight_transfer import backend

    assert len(backend.__all__) <= 45, backend.__all__
    for name in backend.__all__:
        assert getattr(backend, name) is not None, name
    spec = {"WeightSource", "VLLMWeightSyncClient", "TrainerWeightTransferEngine"}
    assert spec | {"WeightTransferEngine", "WeightTransferInitInfo"} <= set(backend.__all__)
    root = Path(__file__).parents[2]
    sources = [*root.glob("plugins/*/src/*/*.py"), *root.glob("examples/*/src/*/*.py")]
    assert sources
    imported = set()
    for path in sources:
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] == ["from"] and words[1].startswith(("weight_transfer", "wt_kits")):
                imported.add(words[1])
                assert words[1] == "weight_transfer.backend" or words[1] not in ENTRY_POINTS, (
                    f"{path.name}: {line.strip()}"
                )
    assert "weight_transfer.backend" in imported
    assert any(module.startswith("wt_kits.") for module in imported)
