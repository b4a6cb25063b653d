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
    proc = _fresh(
        "import importlib, pkgutil, sys, weight_transfer as wt\n"
        "names = [m.name for m in pkgutil.walk_packages(wt.__path__, 'weight_transfer.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('wt_')))\n"
        "apps = ('demo', 'bench', 'tiny_model')\n"
        "print(sorted(n for n in names if n.rsplit('.', 1)[-1] in apps))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "[]"]


def test_backend_module_is_the_authoring_surface() -> None:
    from weight_transfer import backend

    # every name a backend distribution uses from core is public here
    for name in (
        "ResyncTrainerEngine",
        "ParamListUpdateInfo",
        "SendWindow",
        "LoadPipeline",
        "GroupChannel",
        "is_vllm_config",
        "UpdatePayload",
        "checked_iteration",
        "track_sync",
        "DirectLoader",
        "WireProtocolInfo",
        "dtype_from_name",
    ):
        assert name in backend.__all__, name
        assert getattr(backend, name) is not None
    plugins = Path(__file__).parents[2]
    sources = [*plugins.glob("plugins/*/src/*/*.py"), *plugins.glob("examples/*/src/*/*.py")]
    assert sources
    for path in sources:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("from weight_transfer", "import weight_transfer")):
                assert line.lstrip().startswith("from weight_transfer.backend import"), (
                    f"{path.name}: {line.strip()}"
                )
