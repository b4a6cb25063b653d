"""A live fused-MoE model (a tiny Qwen3-MoE) synced exactly into vLLM (CPU; CUDA in `nox -s gpu`).

vLLM's CPU experts kernel prepacks (and pads) its expert weights at load, which
its own layerwise reload then overwrites with unpacked ones (`weight_transfer.
vllm.moe`). Every sync here, of other weights and of the very weights served,
must leave the engine's parameters bit-exact against a fresh engine loaded from
the target checkpoint, and its greedy tokens and logprobs equal to that
engine's. A slice-recording backend refuses the model at init where the kernel
prepacks (vLLM's CPU kernel) and syncs it exactly where none does (CUDA).

The engines run in a process of their own (`tests.vllm.moe_checks`: a MoE model
needs process-wide parallel groups that the dense engines of this process
lack); each test reads its part of what that process saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm.conftest import require_backend

pytest.importorskip("vllm")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

# Only vLLM's CPU experts kernel prepacks its weights (`weight_transfer.vllm.moe`)
PREPACKS = pytest.mark.skipif(torch.cuda.is_available(), reason="no prepacking experts kernel")


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    for backend in ("nccl", "sharded_rdt", "sparse_nccl"):
        require_backend(backend)
    root = tmp_path_factory.mktemp("tiny-moe")
    out = root / "seen.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.moe_checks", str(root), str(out)],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def _part(seen: dict[str, Any], check: str) -> Any:
    result = seen[check]
    assert "crashed" not in result, result.get("crashed") if isinstance(result, dict) else result
    return result


def _exact(step: dict[str, Any], what: str) -> None:
    assert not step["differ"], f"{what}: {len(step['differ'])} tensors differ: {step['differ'][:4]}"
    assert step["tokens_equal"], f"{what}: tokens or logprobs differ from a fresh engine's"


@pytest.mark.parametrize("case", ["nccl-64", "nccl-48"])
def test_a_live_moe_model_is_synced_exactly(seen: dict[str, Any], case: str) -> None:
    """64: the kernel's layout differed silently (same shapes); 48: it pads, so the
    copy failed mid-load. Sync the served weights, then seed 2, then seed 1."""
    steps = _part(seen, "syncs")[case]
    assert [s["what"] for s in steps] == [
        "before any sync", "the served weights again", "seed 2", "seed 1",
    ]  # fmt: skip
    for step in steps:
        _exact(step, f"wt_{case}, {step['what']}")


@PREPACKS
def test_a_round_with_part_of_a_layers_experts_is_refused_and_changes_nothing(
    seen: dict[str, Any],
) -> None:
    """A prepacked experts layer is installed whole or not at all."""
    result = _part(seen, "partial")
    assert result["error"] is not None and "layers.1.mlp.experts" in result["error"]
    assert "part of the layer's experts" in result["error"], result["error"]
    assert result["changed"] == [], f"a refused round changed {result['changed'][:4]}"
    _exact(result["then"], "the complete round after the refused one")


@PREPACKS
def test_a_slice_recording_backend_refuses_the_moe_model_at_init(seen: dict[str, Any]) -> None:
    result = _part(seen, "slices")
    assert result["error"] is not None, "wt_sharded_rdt connected to a prepacked MoE model"
    assert "prepack their expert weights" in result["error"] and "wt_nccl" in result["error"]
    _exact(result["then"], "after the refused init")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's CPU experts kernel prepacks")
def test_a_slice_recording_backend_syncs_the_moe_model_where_no_kernel_prepacks(
    seen: dict[str, Any],
) -> None:
    result = _part(seen, "slices")
    assert result["error"] is None, result["error"]
    assert [s["what"] for s in result["steps"]] == ["seed 2", "seed 1"]
    for step in result["steps"]:
        _exact(step, f"wt_sharded_rdt, {step['what']}")


def test_sparse_patches_of_a_live_moe_model_land_exactly(seen: dict[str, Any]) -> None:
    """A patch of the served values changes nothing; a patch of other values serves
    exactly what a fresh engine of the patched checkpoint serves."""
    result = _part(seen, "sparse")
    _exact(result["same_values"], "a patch of the served values")
    _exact(result["patched"], "a patch of other values")
