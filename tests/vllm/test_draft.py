"""Weight updates aimed at the speculative draft model (`start_draft_weight_update`).

The engine serves seed 1 with a draft model of seed 2, so almost no drafted
token is accepted. After the draft is synced to seed 1, every drafted token is
accepted (greedy draft == greedy target), while the target's outputs stay
exactly those of seed 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    KEEP_ALIVE,
    LLM_KWARGS,
    References,
    TinyDirs,
    connect,
    generate,
    hf_model,
    require_backend,
)
from weight_transfer import LocalVLLMWeightSyncClient, ModuleSource

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class DraftClient(LocalVLLMWeightSyncClient):
    """Opens every round on the draft model."""

    def start_weight_update(self) -> None:
        self._call("start_draft_weight_update")


def acceptance(llm: Any) -> tuple[int, int]:
    """(accepted, drafted) token counts since the engine started."""
    counts = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (
        int(counts["vllm:spec_decode_num_accepted_tokens"]),
        int(counts["vllm:spec_decode_num_draft_tokens"]),
    )


def test_draft_model_sync(tiny_dirs: TinyDirs, references: References, tmp_path: Any) -> None:
    backend = "nccl"
    require_backend(backend)
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    llm = LLM(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend=f"wt_{backend}"),
        speculative_config={
            "method": "draft_model",
            "model": tiny_dirs[2],
            "num_speculative_tokens": 3,
        },
        disable_log_stats=False,
        **LLM_KWARGS,
    )
    KEEP_ALIVE.append(llm)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    assert worker.supports_draft_weight_updates()

    assert generate(llm) == references.outputs(INITIAL_SEED)
    accepted0, drafted0 = acceptance(llm)
    assert drafted0 > 0 and accepted0 < drafted0 // 2

    trainer = connect(
        backend, DraftClient(llm), ModuleSource(hf_model(INITIAL_SEED)), str(tmp_path)
    )
    trainer.send_weights()

    accepted1, drafted1 = acceptance(llm)
    assert generate(llm) == references.outputs(INITIAL_SEED)
    accepted2, drafted2 = acceptance(llm)
    assert drafted2 > drafted1
    assert accepted2 - accepted1 == drafted2 - drafted1, "the draft did not take the new weights"
    assert worker.weight_transfer_engine.model is worker.get_model()  # target reset
    trainer.shutdown()
