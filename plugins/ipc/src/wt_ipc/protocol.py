"""What trainer and workers of the `ipc` backend agree on.

Handshake (`IPCWorkerInitInfo`, JSON-safe, sent once by the trainer): the
data plane (`"shm"` or `"cuda"`), the trainer's control socket and pid, the
wire parameters, and the staging buffers: shared-memory segment names, or
CUDA IPC records (`planes.CudaRecord`: base64 handle bytes, device UUID,
offsets), one list per worker. Nothing in it needs unpickling.

Update info (`IPCUpdateInfo`): core's parameter list plus the trainer's id
and the round's `round_id`. The layout is not sent: both sides derive it from
the parameter list and the wire parameters (`plan_for`), so there is no
offset to forge; the worker checks that the derived layout fits the buffers
it mapped before it reads a byte.

One round on the control link, for each bucket `k` of the layout, in order:
the trainer waits until every worker has released the staging buffer
`k % n` (`RELEASED` frames: "buckets below `value` are free"), writes bucket
`k` into it and sends `READY(round_id, k, nbytes)`; a worker loads bucket `k`
from views into that buffer and releases it once nothing refers to it any
more (core's buffer-reuse rule). A trainer that fails while producing bucket
`k` sends `ABORT(round_id, k)`. Frames of an older round are skipped, so a
round that ends early on either side never leaves the link out of step.

With `verify` (a wire parameter of the handshake), every staging buffer
keeps its bucket's digests in its tail (`DigestRoom`: the layout plans the
bucket bytes into the rest, at most `max_pieces` pieces per bucket); the
trainer writes them before `READY`, and the worker checks the bucket against
them before loading it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.backend import (
    RELEASED,
    BucketPlan,
    DigestRoom,
    ParamListUpdateInfo,
    ParamMeta,
    WeightTransferInitInfo,
    WireParams,
    WireProtocolInfo,
    check_int_range,
    check_timeout,
    plan_buckets,
    plan_per_tensor,
)

__all__ = [
    "IPCWorkerInitInfo",
    "IPCUpdateInfo",
    "TrainerAbortedError",
    "plan_for",
    "digest_room",
    "READY",
    "ABORT",
    "RELEASED",
    "HELLO",
    "PLANES",
    "MAX_WORKERS",
]

READY = 1
ABORT = 2
HELLO = 4  # worker -> trainer after attaching: index = global index, value = pid
PLANES = ("shm", "cuda")
MAX_WORKERS = 64
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class TrainerAbortedError(RuntimeError):
    """The trainer abandoned the round; the worker rolls back."""


@dataclass
class IPCWorkerInitInfo(WireProtocolInfo, WireParams, WeightTransferInitInfo):
    """The handshake a worker receives; see the module docstring.

    `segment_names[i]` is staging buffer `i` (plane "shm");
    `cuda_buffers[w][i]` is buffer `i` as exported for worker `w` (plane
    "cuda": one export per reader, as CUDA IPC pairs each export with one
    open).
    """

    plane: str = field(default="shm", kw_only=True)
    control_path: str = field(default="", kw_only=True)
    trainer_pid: int = field(default=0, kw_only=True)
    segment_names: list[str] = field(default_factory=list, kw_only=True)
    cuda_buffers: list[list[dict[str, Any]]] = field(default_factory=list, kw_only=True)
    timeout_s: float = field(default=300.0, kw_only=True)
    trainer_id: str = field(default="", kw_only=True)
    replace: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        what = "init_info"
        self.validate(what, staged=False)  # the trainer owns the staging memory
        check_timeout(self.timeout_s, field="timeout_s", what=what)
        if self.plane not in PLANES:
            raise ValueError(f"{what}: field 'plane' must be one of {PLANES}, got {self.plane!r}")
        path = self.control_path
        if not os.path.isabs(path) or len(path.encode()) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"{what}: field 'control_path' must be an absolute socket path of at most "
                f"{_MAX_SOCKET_PATH} bytes, got {path!r}"
            )
        check_int_range(self.trainer_pid, field="trainer_pid", what=what, low=1, high=2**31 - 1)
        if self.verify:
            digest_room(self, what)
        n = self.packed_num_buffers
        if self.plane == "shm" and len(self.segment_names) != n:
            raise ValueError(
                f"{what}: field 'segment_names' has {len(self.segment_names)} entries, "
                f"'packed_num_buffers' is {n}"
            )
        if self.plane == "cuda":
            check_int_range(
                len(self.cuda_buffers), field="cuda_buffers", what=what, low=1, high=MAX_WORKERS
            )
            for w, records in enumerate(self.cuda_buffers):
                if len(records) != n:
                    raise ValueError(
                        f"{what}: field 'cuda_buffers[{w}]' has {len(records)} entries, "
                        f"'packed_num_buffers' is {n}"
                    )


@dataclass
class IPCUpdateInfo(ParamListUpdateInfo):
    """Per-round metadata: core's parameter list, the trainer, the round's number."""

    trainer_id: str = ""
    round_id: int = 0


def digest_room(wire: WireParams, what: str = "init_info") -> DigestRoom:
    """Where each staging buffer keeps its bucket's digests (`verify`); `ValueError`
    naming the field when the buffers are too small to hold any."""
    try:
        return DigestRoom.of(wire.packed_buffer_size_bytes)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


def plan_for(metas: list[ParamMeta], wire: WireParams) -> BucketPlan:
    """The round's layout in the staging buffers: packed, or one parameter per bucket;
    with `verify`, in the part of each buffer before its digest room."""
    if not wire.verify:
        if wire.packed:
            return wire.packed_plan(metas)
        return plan_per_tensor(metas, buffer_bytes=wire.packed_buffer_size_bytes)
    room = digest_room(wire)
    if wire.packed:
        return plan_buckets(
            metas,
            buffer_bytes=room.offset,
            min_bucket_bytes=wire.packed_min_bucket_bytes,
            max_pieces=room.max_pieces,
        )
    return plan_per_tensor(metas, buffer_bytes=room.offset)
