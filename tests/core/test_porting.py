"""Code ported from vLLM's weight transfer finds vLLM's names in wt (issue: porting)."""

from __future__ import annotations

import importlib

import pytest

import weight_transfer
import weight_transfer.base as base

PLUGINS = ["wt_nccl", "wt_ipc", "wt_sparse_nccl", "wt_sharded_rdt"]


@pytest.mark.parametrize("plugin", PLUGINS)
def test_vllms_class_names_are_the_backends_own_classes(plugin: str) -> None:
    module = importlib.import_module(plugin)
    assert len(module.VLLM_NAMES) == 4
    for vllm_name, wt_name in module.VLLM_NAMES.items():
        assert getattr(module, vllm_name) is getattr(module, wt_name), vllm_name


def test_vllms_base_names_are_importable_from_weight_transfer_base() -> None:
    """Every name vLLM 0.32's and 0.33's `base` module defines that wt also has."""
    for name in (  # read from both wheels' `vllm/distributed/weight_transfer/base.py`
        "ModuleSource", "ParamMeta", "Placement", "Replicate", "Shard", "TInitInfo",
        "TTrainerInitInfo", "TUpdateInfo", "TrainerInitInfo", "TrainerWeightTransferEngine",
        "VLLMWeightSyncClient", "WeightSource", "WeightTransferEngine", "WeightTransferInitInfo",
        "WeightTransferInitRequest", "WeightTransferUpdateInfo", "WeightTransferUpdatePayload",
        "WeightTransferUpdateRequest", "layerwise_groups", "materialize_full_tensor",
    ):  # fmt: skip
        assert hasattr(base, name), name
    assert base.ModuleSource is weight_transfer.ModuleSource


def test_the_ray_client_takes_vllms_keyword() -> None:
    pytest.importorskip("ray")
    client = weight_transfer.RayVLLMWeightSyncClient(handle=object(), timeout=5.0)
    assert len(client.handles) == 1
