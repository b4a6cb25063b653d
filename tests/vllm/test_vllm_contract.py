"""wt's worker engines against vLLM's worker-facing code, read from source.

Two vLLMs: the one installed here (0.32 on CPU; 0.33 where the GPU build is
installed), read live; and vLLM 0.33.0 as read from its wheel
(`vllm/v1/worker/gpu_worker.py`, `vllm/distributed/weight_transfer/base.py`
and `factory.py` of `vllm==0.33.0`), kept below. Checked: every attribute the
worker reads on its engine exists on every first-party wt engine, and the
engine's constructor and the factory's `create_engine` take the arguments
vLLM passes, by name and in order. (A live 0.33 engine runs in the GPU
script, where the GPU build is installed.)
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from weight_transfer import WeightTransferEngineFactory

pytest.importorskip("vllm")

ENGINE_ARGS = ("config", "vllm_config", "device", "model")

VLLM_0_33_0: dict[str, Any] = {
    "engine_calls": {
        "finish_weight_update",
        "init_transfer_engine",
        "parse_init_info",
        "reset_weight_update_target",
        "set_weight_update_target",
        "shutdown",
        "start_weight_update",
        "supports_draft_weight_update",
        "update_weights",
    },
    "engine_init": ENGINE_ARGS,
    "create_engine": ENGINE_ARGS,
    # `WeightTransferConfig.backend` (vllm/config/weight_transfer.py): any registered name
    "config_backend_takes_any_name": True,
    # the RL entry points (vllm/entrypoints/rl/): where wt's bridge wraps them, unmoved since 0.32
    "rl_modules": {"vllm.entrypoints.rl.offline", "vllm.entrypoints.rl.online.api_router"},
    # `abort_weight_update` is in no route, engine, `LLM` or worker of 0.33.0: wt answers it itself
    "has_abort_weight_update": False,
}


def installed_vllm() -> dict[str, Any]:
    """The same facts, read from the vLLM installed here."""
    from vllm.distributed.weight_transfer import base, factory

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    worker = root / "v1" / "worker" / "gpu_worker.py"
    calls = set(re.findall(r"weight_transfer_engine\.(\w+)", worker.read_text()))
    from vllm.config.weight_transfer import WeightTransferConfig as VLLMConfig

    rl = root / "entrypoints" / "rl"
    modules = {"vllm.entrypoints.rl.offline", "vllm.entrypoints.rl.online.api_router"}
    sources = [p.read_text() for p in (root / "v1" / "engine").glob("*.py")]
    return {
        "engine_calls": calls,
        "engine_init": _parameters(base.WeightTransferEngine.__init__),
        "create_engine": _parameters(factory.WeightTransferEngineFactory.create_engine),
        "config_backend_takes_any_name": str
        in getattr(inspect.get_annotations(VLLMConfig, eval_str=True)["backend"], "__args__", ()),
        "rl_modules": {
            m for m in modules if (rl / (m.split(".rl.")[1].replace(".", "/") + ".py")).exists()
        },
        "has_abort_weight_update": any("def abort_weight_update" in s for s in sources)
        or hasattr(base.WeightTransferEngine, "abort_weight_update"),
    }


def _parameters(function: Any) -> tuple[str, ...]:
    return tuple(n for n in inspect.signature(function).parameters if n not in ("self", "cls"))


@pytest.mark.parametrize("which", ["vllm-0.33.0", "installed"])
def test_every_engine_answers_what_vllms_worker_calls_with_its_arguments(which: str) -> None:
    facts = VLLM_0_33_0 if which == "vllm-0.33.0" else installed_vllm()
    assert facts["engine_calls"] >= {"init_transfer_engine", "update_weights"}, facts
    assert facts["create_engine"] == ENGINE_ARGS
    assert _parameters(WeightTransferEngineFactory.create_engine) == facts["create_engine"]
    registry = WeightTransferEngineFactory.registry
    for name in ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "example_file"):
        engine = registry.resolve(name)
        missing = sorted(c for c in facts["engine_calls"] if not hasattr(engine, c))
        assert not missing, f"{name}: {engine.__name__} lacks {missing} ({which})"
        assert _parameters(engine.__init__) == facts["engine_init"], (name, which)


@pytest.mark.parametrize("which", ["vllm-0.33.0", "installed"])
def test_wt_backends_are_selectable_and_its_rl_wrappers_find_their_modules(which: str) -> None:
    """`WeightTransferConfig(backend="wt_nccl")` is a valid vLLM config; the RL entry
    points wt wraps are where it imports them; every wt engine answers
    `abort_weight_update` (vLLM has none to follow: if it gains one, revisit)."""
    facts = VLLM_0_33_0 if which == "vllm-0.33.0" else installed_vllm()
    assert facts["config_backend_takes_any_name"], which
    assert facts["rl_modules"] == VLLM_0_33_0["rl_modules"], which
    assert facts["has_abort_weight_update"] is False, which
    for name in ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "example_file"):
        engine = WeightTransferEngineFactory.registry.resolve(name)
        assert callable(getattr(engine, "abort_weight_update", None)), name


# What `weight_transfer.vllm.adapters` uses of vLLM's LoRA code (vLLM 0.33.0's wheel has each of
# them, with the same `from_lora_tensors` parameters: read from its source).
LORA_BRIDGE = {
    "vllm.lora.worker_manager:WorkerLoRAManager": ("_load_adapter", "add_adapter"),
    "vllm.lora.model_manager:LoRAModelManager": (
        "_create_merged_loras_inplace",
        "add_adapter",
        "get_adapter",
        "remove_adapter",
    ),
    "vllm.lora.peft_helper:PEFTHelper": ("from_dict", "validate_legal"),
    "vllm.lora.utils:parse_fine_tuned_lora_name": (),
    "vllm.exceptions:LoRAAdapterNotFoundError": (),
}
FROM_LORA_TENSORS = (
    "lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size",
    "weights_mapper", "skip_prefixes",
)  # fmt: skip


def test_the_lora_bridge_finds_what_it_uses_in_the_installed_vllm() -> None:
    import importlib

    from vllm.lora.lora_model import LoRAModel

    for where, attributes in LORA_BRIDGE.items():
        module, _, name = where.partition(":")
        owner = getattr(importlib.import_module(module), name)
        assert [a for a in attributes if not hasattr(owner, a)] == [], where
    assert tuple(inspect.signature(LoRAModel.from_lora_tensors).parameters) == FROM_LORA_TENSORS
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    # the links the bridge follows: model -> its LoRA manager, worker's runner -> the worker manager
    assert "self.model.lora_manager = self" in (root / "lora" / "model_manager.py").read_text()
    mixin = (root / "v1" / "worker" / "lora_model_runner_mixin.py").read_text()
    assert "self.lora_manager = LRUCacheWorkerLoRAManager(" in mixin


# What `weight_transfer.vllm.patches` and `gate` wrap or call in vLLM (vLLM 0.33.0's wheel has each
# of them, with the same parameters, and its `MultiprocExecutor.collective_rpc` still stops reading
# replies at the first failed worker unless fault tolerance is on: read from its source).
ENTRY_POINTS = {
    "vllm.v1.engine.async_llm:AsyncLLM": ("finish_weight_update", "update_weight_version"),
    "vllm.entrypoints.rl.offline:RLOfflineMixin": ("finish_weight_update",),
    "vllm.v1.engine.core:EngineCore": ("add_request", "collective_rpc"),
    "vllm.v1.engine.core:EngineCoreProc": ("_send_error_outputs_to_client",),
    "vllm.v1.engine.llm_engine:LLMEngine": ("add_request", "set_weight_version"),
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor": ("collective_rpc",),
    "vllm.v1.core.sched.scheduler:Scheduler": ("finish_requests",),
}
SIGNATURES = {
    "vllm.v1.engine.async_llm:AsyncLLM.finish_weight_update": ("weight_version",),
    "vllm.entrypoints.rl.offline:RLOfflineMixin.finish_weight_update": ("weight_version",),
    "vllm.v1.engine.core:EngineCore.add_request": ("request", "request_wave"),
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc": (
        "method", "timeout", "args", "kwargs", "non_block", "unique_reply_rank",
        "kv_output_aggregator", "ec_output_aggregator",
    ),
}  # fmt: skip


def _resolve(where: str) -> Any:
    import importlib

    module, _, path = where.partition(":")
    owner = importlib.import_module(module)
    for part in path.split("."):
        owner = getattr(owner, part)
    return getattr(owner, "__wrapped__", owner)  # wt's wrappers keep vLLM's own beside them


def test_the_entry_points_wt_wraps_are_where_it_wraps_them_in_the_installed_vllm() -> None:
    for where, attributes in ENTRY_POINTS.items():
        owner = _resolve(where)
        assert [a for a in attributes if not hasattr(owner, a)] == [], where
    for where, parameters in SIGNATURES.items():
        assert _parameters(_resolve(where)) == parameters, where
    from vllm.v1.request import RequestStatus

    assert RequestStatus.FINISHED_ERROR.name == "FINISHED_ERROR"
    from vllm.v1.engine.core_client import InprocClient

    assert "self.engine_core = EngineCore(" in inspect.getsource(InprocClient.__init__)
    from vllm.v1.worker.gpu_worker import Worker

    assert "self._weight_update_active = False" in inspect.getsource(Worker.__init__)


def test_an_engine_with_eplb_refuses_every_init_naming_eplb() -> None:
    """EPLB moves experts between physical slots at run time (vLLM's CPU build cannot
    run it: the config is built, not an engine); the engine's configuration alone
    refuses the init, before the backend connects."""
    from vllm.config import ParallelConfig, VllmConfig

    from tests.core.helpers import EchoEngine, TinyModel
    from weight_transfer import WeightTransferConfig
    from weight_transfer.payload import WIRE_PROTOCOL_VERSION
    from weight_transfer.runtime.hosts import register_host
    from weight_transfer.runtime.worker_round import guarded
    from weight_transfer.vllm.host import VLLMHost

    register_host(VLLMHost())  # as wt's vLLM plugin does in every vLLM process
    init = {"wire_protocol": WIRE_PROTOCOL_VERSION, "endpoint": "tcp://127.0.0.1:1"}
    for eplb in (True, False):
        config = VllmConfig(parallel_config=ParallelConfig())
        # set after the checks, which want a GPU engine for EPLB
        object.__setattr__(config.parallel_config, "enable_eplb", eplb)
        engine = guarded(EchoEngine(WeightTransferConfig("echo"), config, "cpu", TinyModel()))
        if eplb:
            with pytest.raises(ValueError, match=r"EPLB, enable_eplb=True.*--enable-eplb"):
                engine.init_transfer_engine(engine.parse_init_info(init))
            assert engine.calls == [] and not engine.connected
        else:
            engine.init_transfer_engine(engine.parse_init_info(init))
            assert engine.calls == ["init"] and engine.connected
