"""Run inside a fresh venv by `nox -s wheels`: argv[1] is the comma-separated set of
backends both factories must find (empty for wt-core alone)."""

import importlib
import pkgutil
import sys

import weight_transfer
from weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

expected = {b for b in sys.argv[1].split(",") if b}
heavy = {"vllm", "ray", "httpx"} & set(sys.modules)
assert not heavy, f"import weight_transfer imported {heavy}"
# Core holds no application and imports no plugin: every module imports alone.
for module in pkgutil.walk_packages(weight_transfer.__path__, "weight_transfer."):
    if module.name.startswith("weight_transfer.testing.") and module.name.rpartition(".")[2] in (
        "conformance",
        "plugin",
        "seams",
    ):
        continue  # the [testing] extra's (pytest, wt-kits)
    importlib.import_module(module.name)
plugins = sorted(m for m in sys.modules if m.startswith("wt_"))
assert not plugins, f"wt-core's modules imported {plugins}"
for factory in (WeightTransferTrainerFactory, WeightTransferEngineFactory):
    found = factory.available_backends()
    assert set(found) == expected, (
        f"{factory.__name__} found {sorted(found)}, expected {sorted(expected)}"
    )
    for name in expected:
        assert found[name].distribution == f"wt-{name.replace('_', '-')}", found[name]
        factory.get_engine_class(name)
# `pip install wt-core wt-nccl` gives a working HTTP client: httpx comes with wt-core.
from weight_transfer import HTTPVLLMWeightSyncClient  # noqa: E402

HTTPVLLMWeightSyncClient("http://127.0.0.1:1").close()
assert "httpx" in sys.modules
print(f"wt-core {weight_transfer.__version__}: backends {sorted(expected) or 'none'} as expected")
