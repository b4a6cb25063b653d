"""wt-sparse-nccl's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_sparse_nccl.conformance:PROFILE

A delta backend takes no `WeightSource`: each round of the suite is a dense
patch per tensor (every entry), so a round leaves the workers holding the
suite's tensors exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weight_transfer.testing.profile import Profile
from wt_kits.group import free_port


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_sparse_nccl import SparseNCCLTrainerInitInfo

    return SparseNCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + workers, rank=0, timeout_s=timeout_s,
        replace_trainer=replace, **wire,
    )  # fmt: skip


def send(engine: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """One round setting every entry of every tensor."""
    from wt_sparse_nccl import SparseWeightPatch

    patches = [
        SparseWeightPatch(name, torch.arange(t.numel()), t.reshape(-1), tuple(t.shape))
        for name, t in tensors.items()
    ]
    engine.send_weights(patches)


PROFILE = Profile(
    "sparse_nccl",
    trainer_info,
    wire_modes={"default": {}, "verified": {"verify": True}},
    send=send,
    loads_by_name=False,
)
