"""Importing the package stays light: no httpx, ray or vllm until a piece needs them."""

from __future__ import annotations

import subprocess
import sys

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
