"""Verified bytes inside a live vLLM (in-process `LLM`): with `verify=True` a sync is exact,
a byte flipped in transit refuses the round naming the parameter and the engine keeps
serving the previous weights, and the next sync works.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the test-only
transport hook installed here (`corrupt_received`) runs inside its worker.
"""

from __future__ import annotations

import pytest

from tests.harness import corrupt_received
from tests.vllm.conftest import References, ServedEngines, generate, hf_model
from weight_transfer import ModuleSource, WeightSyncRPCError

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize(
    ("backend", "add"), [("nccl", None), ("ipc", None), ("nccl", [1, -2, 1])],
    ids=["nccl-flipped-byte", "ipc-flipped-byte", "nccl-plus-one-minus-two-plus-one"],
)  # fmt: skip
def test_verified_syncs_refuse_a_corrupt_byte_and_keep_serving(
    served: ServedEngines, references: References, backend: str, add: list[int] | None
) -> None:
    """A flipped byte, or +1, -2, +1 added to three consecutive 32-bit words (which the
    previous Fletcher-style digest missed), is refused naming the parameter."""
    engine = served(backend)
    engine.reconnect(verify=True)
    try:
        first = 3 if engine.seed == 2 else 2
        second = 1 if first != 1 else 3
        engine.sync(first, version="verified")
        assert generate(engine.llm) == references.outputs(first)
        assert engine.llm.get_weight_version() == "verified"

        plan = engine.trainer.plan_for(ModuleSource(hf_model(second)).metadata())
        k = len(plan.buckets) // 2
        piece = plan.buckets[k].pieces[0]
        name = plan.params[piece.param].name
        at = piece.offset + (piece.nbytes // 2) // 4 * 4
        corrupt_received(k, at, 0x01, add)
        try:
            with pytest.raises(WeightSyncRPCError) as failure:
                engine.sync(second)
        finally:
            corrupt_received(None)
        assert failure.value.method == "update_weights"
        assert f"bucket {k} of {len(plan.buckets)}: parameter {name!r}" in str(failure.value)
        assert generate(engine.llm) == references.outputs(first), "a refused sync changed weights"

        engine.sync(second, version="verified-again")
        assert generate(engine.llm) == references.outputs(second)
    finally:
        engine.reconnect()  # other tests share this engine: back to a plain trainer
