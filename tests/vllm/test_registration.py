"""The `vllm.general_plugins` entry point registers wt engines in vLLM's factory, lazily."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.vllm.conftest import ServedEngines

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm]

PLUGIN_MODULES = ("wt_nccl", "wt_example", "wt_sparse_nccl", "wt_ipc", "wt_sharded_rdt")

# Runs in a fresh interpreter: which modules are imported is the point.
PROBE = textwrap.dedent(
    """
    import json, sys
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
    from weight_transfer import WeightTransferEngineFactory
    from weight_transfer.vllm.plugin import register

    class Taken:
        pass

    F.register_engine("wt_example_file", Taken)  # a name vLLM already has keeps its engine
    builtin = {n: F._registry[n] for n in F._registry}
    first = register()
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # the entry point: register() again, in the vLLM way
    again = register()
    out = {
        "wt_backends": sorted(WeightTransferEngineFactory.available_backends()),
        "registry": sorted(F._registry),
        "first": first,
        "again": again,
        "builtin_kept": all(F._registry[n] is f for n, f in builtin.items()),
        "taken_kept": F._registry["wt_example_file"]() is Taken,
        "imported_before": sorted(m for m in MODULES if m in sys.modules),
    }
    if "wt_nccl" in F._registry:
        cls = F._registry["wt_nccl"]()
        backend = cls.backend_cls  # vLLM instantiates core's GuardedEngine around it
        out["nccl_class"] = backend.__module__ + ":" + backend.__qualname__
    out["imported_after"] = sorted(m for m in MODULES if m in sys.modules)
    print("PROBE" + json.dumps(out))
    """
)


def run_probe() -> dict[str, Any]:
    code = f"MODULES = {PLUGIN_MODULES!r}\n{PROBE}"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))
    result: dict[str, Any] = json.loads(line[len("PROBE") :])
    return result


def test_plugin_registers_every_wt_engine_lazily() -> None:
    probe = run_probe()
    wt_names = [f"wt_{n}" for n in probe["wt_backends"]]
    assert "wt_example_file" in wt_names
    for name in wt_names:
        assert name in probe["registry"]
    assert "wt_example_file" not in probe["first"]  # already taken: left alone
    assert sorted(probe["first"]) == sorted(n for n in wt_names if n != "wt_example_file")
    assert probe["again"] == []
    assert probe["builtin_kept"] and probe["taken_kept"]
    for builtin in ("nccl", "ipc"):
        assert builtin in probe["registry"]
    assert probe["imported_before"] == []
    if "nccl_class" in probe:
        assert probe["nccl_class"] == "wt_nccl.worker:NCCLWorkerEngine"
        assert probe["imported_after"] == ["wt_nccl"]


def test_engine_inside_vllm_is_the_wt_engine(served: ServedEngines) -> None:
    engine = served("example_file")
    from weight_transfer import WeightTransferEngine
    from weight_transfer.runtime.worker_round import GuardedEngine
    from weight_transfer.vllm.loader import VLLMLoader
    from wt_example.worker import FileWorkerEngine

    guard = engine.worker_engine
    assert isinstance(guard, GuardedEngine)  # vLLM runs the backend's engine inside core's round
    wt_engine = guard.backend
    assert isinstance(wt_engine, FileWorkerEngine)
    assert isinstance(wt_engine, WeightTransferEngine) and wt_engine.round is guard
    assert wt_engine.position.global_index == 0 and wt_engine.position.total_workers == 1
    assert wt_engine.device.type == "cpu"
    assert isinstance(wt_engine.new_loader(), VLLMLoader)


def test_unknown_wt_backend_names_what_is_installed() -> None:
    from weight_transfer.vllm import engines

    with pytest.raises(ValueError, match="unknown weight transfer engine backend 'nope'"):
        engines.wt_nope  # noqa: B018
    with pytest.raises(AttributeError):
        engines.nccl  # noqa: B018
