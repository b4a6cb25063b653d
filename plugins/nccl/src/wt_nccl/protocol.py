"""What trainer and workers of the `nccl` backend agree on.

Handshake (`NCCLWorkerInitInfo`, sent once by the trainer): the group's
address and size, the transport library, and every wire parameter (`packed`,
buffer size and count, minimum bucket size). Workers read these from the
handshake only; `NCCLUpdateInfo` carries per-round metadata.

One round on the wire, for each bucket `k` of `plan_for(...)` in order:
a header broadcast (`Header`, `int64[8]`), then, if its status is `OK`, the
bucket's bytes and, with `verify` (a wire parameter of the handshake), the
digests of its pieces (`int64[pieces, 2]`, core's `BucketDigests`). A
trainer that fails while producing bucket `k` (a source that disagrees with
its metadata, say) broadcasts an `ABORT` header instead, so every worker
stops at the same point and the group stays aligned for the next round.

The header is the only receive whose size a worker knows before the round
starts. It carries what the trainer sends: the bucket's byte and piece
counts, the number of buckets, and the digests of the trainer's declared
parameter list (`param_list_digests`). A worker compares them with the plan
it derived from its update info before it sizes any other receive; an
update info that differs from the trainer's (rewritten on its way, or
posted by someone else during the trainer's round) is refused naming the
field, after the worker has received the rest of the round as the trainer's
headers size it (`Header.disagreement`, `NCCLWorkerEngine._drain`): a gloo
receive of the wrong size would abort the worker's process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.backend import PARAM_LIST_FIELDS, ParamListUpdateInfo, ParamMeta
from wt_kits.group import GroupInitInfo
from wt_kits.stream import Bucket, BucketPlan, Piece, WireParams

__all__ = [
    "NCCLWorkerInitInfo",
    "NCCLUpdateInfo",
    "WireParams",
    "plan_for",
    "HEADER_OK",
    "HEADER_ABORT",
    "TrainerAbortedError",
    "Header",
    "HEADER_LEN",
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


@dataclass(frozen=True)
class Header:
    """The broadcast before each bucket; see the module docstring."""

    bucket: int
    status: int
    nbytes: int
    pieces: int
    buckets: int
    declared: tuple[int, ...]  # `param_list_digests` of the trainer's parameter list

    @classmethod
    def of(cls, k: int, status: int, plan: BucketPlan, declared: Sequence[int]) -> Header:
        """The trainer's header of bucket `k` of `plan` (any status; no bytes follow ABORT)."""
        bucket = plan.buckets[k] if k < len(plan.buckets) else None
        nbytes, pieces = (bucket.nbytes, len(bucket.pieces)) if bucket else (0, 0)
        return cls(k, status, nbytes, pieces, len(plan.buckets), tuple(declared))

    @classmethod
    def parse(cls, values: Sequence[int]) -> Header:
        bucket, status, nbytes, pieces, buckets, *declared = values
        return cls(bucket, status, nbytes, pieces, buckets, tuple(declared))

    def tensor(self, device: torch.device) -> torch.Tensor:
        values = [self.bucket, self.status, self.nbytes, self.pieces, self.buckets]
        return torch.tensor([*values, *self.declared], dtype=torch.int64, device=device)

    def disagreement(self, plan: BucketPlan, declared: Sequence[int]) -> str | None:
        """Why the worker's `plan` (from `declared`, its update info's digests) is not
        what the trainer sends in this bucket, or None when it is."""
        for name, ours, theirs in zip(PARAM_LIST_FIELDS, declared, self.declared, strict=True):
            if ours != theirs:
                return (
                    f"update_info: field {name!r} differs from the parameter list the trainer "
                    "sends (the update info was altered on its way, or does not come from "
                    "this round's trainer)"
                )
        k = self.bucket
        mine = plan.buckets[k] if k < len(plan.buckets) else None
        if mine is None or (self.buckets, self.nbytes, self.pieces) != (
            len(plan.buckets),
            mine.nbytes,
            len(mine.pieces),
        ):
            return (
                f"bucket {k}: the trainer sends {self.buckets} buckets, this one of "
                f"{self.nbytes} bytes in {self.pieces} pieces, which the worker's plan does "
                "not match: the two sides derive different layouts"
            )
        return None


HEADER_LEN = 5 + len(PARAM_LIST_FIELDS)
