"""What trainer and workers of the `nccl` backend agree on.

Handshake (`NCCLWorkerInitInfo`, sent once by the trainer): the group's
address and size, the transport library, and every wire parameter (`packed`,
buffer size and count, minimum bucket size, `verify`). Workers read these
from the handshake only; `NCCLUpdateInfo` carries per-round metadata.

Both ends derive the round's buckets from the update info (`plan_for`), so
nothing per bucket but its bytes crosses the wire. One round:

1. `RoundHeader` (`int64[1 + 3]`): the number of buckets and the digests of
   the trainer's declared parameter list (`param_list_digests`), then the
   trainer's layout (`layout_rows`: `int64[buckets, 3]`, per bucket its bytes,
   pieces, and whether it is solo). These are the only receives a worker sizes
   from the wire; it compares them with its own plan before sizing any other.
2. Per bucket `k`, one broadcast of `message_bytes(bucket)` bytes: the bucket's
   bytes, then a status tail `int64[2]` (`k`, `STATUS_OK` or `STATUS_ABORT`) at
   the next 8-byte boundary. A solo bucket (one piece: a tensor that fills a
   bucket, or a piece of one larger than a bucket) goes out from the source's
   own memory, without a copy to append a tail to, so its status goes first, in
   a broadcast of its own. With `verify`, the digests of the bucket's pieces
   (`int64[pieces, 2]`, `BucketDigests`) follow its bytes.

A trainer that fails while producing bucket `k` (a source that disagrees with
its metadata, a non-finite value) sends `k`'s status as `STATUS_ABORT` (the
tail of a message whose body is not loaded, or a solo bucket's status with no
bytes after it), so every worker stops at the same collective, before it loads
anything of `k`, and the group carries the next round.

An update info that differs from the trainer's (rewritten on its way, or
posted by someone else during the trainer's round) is refused naming the
field, after the worker has received the rest of the round as the trainer's
layout sizes it (`NCCLWorkerEngine._drain`): a gloo receive of the wrong size
would abort the worker's process.
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
    "STATUS_OK",
    "STATUS_ABORT",
    "STATUS_LEN",
    "LAYOUT_COLUMNS",
    "TrainerAbortedError",
    "RoundHeader",
    "ROUND_HEADER_LEN",
    "is_solo",
    "layout_rows",
    "message_bytes",
    "tail_of",
]

STATUS_OK = 0
STATUS_ABORT = 1
STATUS_LEN = 2  # int64: the bucket's index, its status
_TAIL_BYTES = 8 * STATUS_LEN
LAYOUT_COLUMNS = 3  # per bucket: bytes, pieces, solo


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


def is_solo(bucket: Bucket) -> bool:
    """Whether `bucket` goes out as one piece's own bytes, its status before it."""
    return len(bucket.pieces) == 1 and bucket.pieces[0].nbytes > 0


def message_bytes(nbytes: int, solo: bool) -> int:
    """The length of a bucket's broadcast: its `nbytes`, and the status tail unless solo."""
    return nbytes if solo else _tail_offset(nbytes) + _TAIL_BYTES


def tail_of(message: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The status tail (`int64[2]`) in `message`, the `uint8` broadcast of a bucket of
    `nbytes` bytes that is not solo."""
    start = _tail_offset(nbytes)
    return message[start : start + _TAIL_BYTES].view(torch.int64)


def _tail_offset(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def layout_rows(plan: BucketPlan) -> list[list[int]]:
    """Per bucket of `plan`: its bytes, its pieces, 1 if solo else 0."""
    rows = plan.derived.get("nccl_layout")
    if rows is None:
        rows = [[b.nbytes, len(b.pieces), int(is_solo(b))] for b in plan.buckets]
        plan.derived["nccl_layout"] = rows
    return rows


@dataclass(frozen=True)
class RoundHeader:
    """The first broadcast of a round; see the module docstring."""

    buckets: int
    declared: tuple[int, ...]  # `param_list_digests` of the trainer's parameter list

    @classmethod
    def parse(cls, values: Sequence[int]) -> RoundHeader:
        buckets, *declared = values
        return cls(buckets, tuple(declared))

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.buckets, *self.declared], dtype=torch.int64, device=device)

    def disagreement(
        self, rows: list[list[int]], plan: BucketPlan, declared: Sequence[int]
    ) -> str | None:
        """Why the worker's `plan` (from `declared`, its update info's digests) is not
        what the trainer sends (`rows`, its `layout_rows`), or None when it is."""
        for name, ours, theirs in zip(PARAM_LIST_FIELDS, declared, self.declared, strict=True):
            if ours != theirs:
                return (
                    f"update_info: field {name!r} differs from the parameter list the trainer "
                    "sends (the update info was altered on its way, or does not come from "
                    "this round's trainer)"
                )
        mine = layout_rows(plan)
        if rows != mine:
            k = next(
                (k for k, (a, b) in enumerate(zip(rows, mine, strict=False)) if a != b),
                min(len(rows), len(mine)),
            )
            return (
                f"bucket {k}: the trainer sends {len(rows)} buckets in a layout the worker's "
                f"plan ({len(mine)} buckets) does not match: the two sides derive different "
                "layouts"
            )
        return None


ROUND_HEADER_LEN = 1 + len(PARAM_LIST_FIELDS)
