"""What trainer and workers of the `nccl` backend agree on.

Handshake (`NCCLWorkerInitInfo`, sent once by the trainer): the group's
address and size, the transport library, and every wire parameter (`packed`,
buffer size and count, minimum bucket size). Workers read these from the
handshake only; `NCCLUpdateInfo` carries per-round metadata.

One round on the wire, for each bucket `k` of `plan_for(...)` in order:
a header broadcast `int64[k, status]`, then, if `status` is `OK`, the bucket's
bytes and, with `verify` (a wire parameter of the handshake), the digests of
its pieces (`int64[pieces, 2]`, core's `BucketDigests`). A trainer that
fails while producing bucket `k` (a source that disagrees with its metadata,
say) broadcasts `[k, ABORT]` instead, so every worker stops at the same point
and the group stays aligned for the next round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weight_transfer.backend import (
    Bucket,
    BucketPlan,
    GroupInitInfo,
    ParamListUpdateInfo,
    ParamMeta,
    Piece,
    WireParams,
)

__all__ = [
    "NCCLWorkerInitInfo",
    "NCCLUpdateInfo",
    "WireParams",
    "plan_for",
    "HEADER_OK",
    "HEADER_ABORT",
    "TrainerAbortedError",
    "header",
]

HEADER_OK = 0
HEADER_ABORT = 1


class TrainerAbortedError(RuntimeError):
    """The trainer abandoned the round; the worker rolls back."""


@dataclass
class NCCLWorkerInitInfo(WireParams, GroupInitInfo):
    """The handshake a worker receives; see the module docstring."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate("init_info")


@dataclass
class NCCLUpdateInfo(ParamListUpdateInfo):
    """Per-round metadata: the parameters in wire order (core's shared parameter
    list), and the trainer the round comes from."""

    trainer_id: str = ""


def plan_for(metas: list[ParamMeta], wire: WireParams) -> BucketPlan:
    """The round's buckets: the packed layout, or one whole tensor per bucket unpacked."""
    if wire.packed:
        return wire.packed_plan(metas)
    buckets = tuple(Bucket((Piece(i, 0, m.nbytes, 0),), m.nbytes) for i, m in enumerate(metas))
    return BucketPlan(tuple(metas), buckets, tuple(range(len(metas))))


def header(k: int, status: int, device: torch.device) -> torch.Tensor:
    """The header broadcast before bucket `k`: `int64[k, status]`."""
    return torch.tensor([k, status], dtype=torch.int64, device=device)
