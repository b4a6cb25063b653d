"""The reference example backend (`tests/spec_example`) inside a live vLLM, as `wt_my_backend`.

The throwaway distribution is put on `sys.path`, wt's vLLM plugin registers it
(`register()` picks up backends that appeared since vLLM loaded its plugins),
and an in-process `LLM` created with `backend="wt_my_backend"` receives three
rounds: greedy tokens and logprobs equal a fresh engine's. The reference example's worker
calls `self.model.load_weights` itself; the layerwise reload and the rollback
around it are core's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.spec_example import install_spec_example
from tests.vllm.conftest import (
    INITIAL_SEED,
    KEEP_ALIVE,
    LLM_KWARGS,
    AlteredSource,
    References,
    SwitchSource,
    TinyDirs,
    generate,
    hf_model,
)
from weight_transfer import (
    LocalVLLMWeightSyncClient,
    ModuleSource,
    WeightSyncRPCError,
    WeightTransferTrainerFactory,
)

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_spec_example_syncs_into_a_live_vllm(
    tiny_dirs: TinyDirs,
    references: References,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer.vllm.plugin import register

    monkeypatch.syspath_prepend(str(install_spec_example(tmp_path / "site")))
    assert "wt_my_backend" in register()
    llm = LLM(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend="wt_my_backend"),
        **LLM_KWARGS,
    )
    KEEP_ALIVE.append(llm)
    assert generate(llm) == references.outputs(INITIAL_SEED)

    info_cls: Any = WeightTransferTrainerFactory.get_engine_class("my_backend").init_info_cls
    (tmp_path / "xfer").mkdir()
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer: Any = WeightTransferTrainerFactory.trainer_init(
        info_cls(endpoint=str(tmp_path / "xfer"), rank=0),
        client=LocalVLLMWeightSyncClient(llm),
        source=source,
    )
    for seed in (2, 3):
        source.inner = ModuleSource(hf_model(seed))
        trainer.send_weights()
        assert generate(llm) == references.outputs(seed), f"seed {seed}"

    # vLLM's loader refuses a name half-way through; the reference example's engine does
    # nothing about it, and the model still serves seed 3's weights.
    down = "model.layers.1.mlp.down_proj.weight"
    model = hf_model(2)
    bogus: torch.Tensor = dict(model.named_parameters())[down]
    source.inner = AlteredSource(model, {down: ("model.layers.1.mlp.bogus_proj.weight", bogus)})
    with pytest.raises(WeightSyncRPCError, match="bogus_proj"):
        trainer.send_weights()
    assert generate(llm) == references.outputs(3)

    source.inner = ModuleSource(hf_model(2))
    trainer.send_weights()
    assert generate(llm) == references.outputs(2)


def test_the_documented_backend_syncs_into_a_live_vllm(
    tiny_dirs: TinyDirs,
    references: References,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/writing-a-backend.md, section 6, run as written."""
    import importlib

    from tests.writing_a_backend import install_from_doc
    from weight_transfer.vllm.plugin import register

    monkeypatch.syspath_prepend(str(install_from_doc(tmp_path)))
    assert "wt_lite" in register()
    use_in_vllm = importlib.import_module("use_in_vllm")
    llm = use_in_vllm.sync_into_vllm(tiny_dirs[INITIAL_SEED], hf_model(3), **LLM_KWARGS)
    KEEP_ALIVE.append(llm)
    assert generate(llm) == references.outputs(3)
    assert llm.get_weight_version() == "lite-1"
