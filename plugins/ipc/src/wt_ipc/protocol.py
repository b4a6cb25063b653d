"""What trainer and workers of the `ipc` backend agree on.

Handshake (`IPCWorkerInitInfo`, JSON-safe, sent once by the trainer): the
data plane (`"shm"` or `"cuda"`), the trainer's control socket and pid, the
wire parameters, and the staging buffers: shared-memory segment names, or
CUDA IPC records (`planes.CudaRecord`: base64 handle bytes, device UUID,
offsets), one list per worker. Nothing in it needs unpickling.

Every staging buffer begins with the trainer's seal (`StagingSeal`,
`SEAL_BYTES`; the bucket bytes follow it): the buffer's index, the wire
parameters, the trainer id's digest and a nonce drawn for this staging. The
nonce reaches each worker on the control link (`SEAL`, the first frame the
trainer sends on a link it accepted), not in the handshake, so a handshake that
repeats, reorders or substitutes buffers (even other buffers of the same
process) or misstates the wire parameters is refused naming the entry before
anything is loaded; repeated entries are refused by name before any is mapped.

Update info (`IPCUpdateInfo`): core's parameter list plus the trainer's id
and the round's `round_id`. The layout is not sent: both sides derive it from
the parameter list and the wire parameters (`plan_for`), so there is no
offset to forge; the worker checks that the derived layout fits the buffers
it mapped before it reads a byte.

One round on the control link: first `LAYOUT(round_id, i, digest)` for each
field `i` of `PARAM_LIST_FIELDS` (core's `param_list_digests` of the update
info the trainer sent), which the worker compares with the update info it was
handed before it loads a byte (an update altered on its way is refused naming
the field, in step with the trainer, so the link carries the next round); then
for each bucket `k` of the layout, in order:
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

import hashlib
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.backend import (
    ParamListUpdateInfo,
    ParamMeta,
    WeightTransferInitInfo,
    WireProtocolInfo,
    check_int_range,
    check_timeout,
)
from wt_kits.colocated import RELEASED
from wt_kits.stream import (
    BucketPlan,
    DigestRoom,
    WireParams,
    plan_buckets,
    plan_per_tensor,
)

__all__ = [
    "IPCWorkerInitInfo",
    "IPCUpdateInfo",
    "StagingSeal",
    "SEAL_BYTES",
    "TrainerAbortedError",
    "plan_for",
    "digest_room",
    "READY",
    "ABORT",
    "RELEASED",
    "HELLO",
    "SEAL",
    "LAYOUT",
    "PLANES",
    "MAX_WORKERS",
]

READY = 1
ABORT = 2
HELLO = 4  # worker -> trainer after attaching: index = global index, value = pid
SEAL = 5  # trainer -> worker, first on its link: value = the staging's nonce
LAYOUT = 6  # trainer -> workers, first in a round: index = field, value = its digest
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
        if self.plane == "shm":
            if len(self.segment_names) != n:
                raise ValueError(
                    f"{what}: field 'segment_names' has {len(self.segment_names)} entries, "
                    f"'packed_num_buffers' is {n}"
                )
            _refuse_repeats(self.segment_names, "segment_names", what)
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
                _refuse_repeats([_cuda_identity(r) for r in records], f"cuda_buffers[{w}]", what)


def _refuse_repeats(entries: list[Any], name: str, what: str) -> None:
    """`ValueError` naming the first entry of `entries` that repeats an earlier one."""
    first: dict[Any, int] = {}
    for i, entry in enumerate(entries):
        if entry in first:
            raise ValueError(
                f"{what}: field '{name}[{i}]' repeats '{name}[{first[entry]}]' (each staging "
                "buffer is listed once, in order)"
            )
        first[entry] = i


def _cuda_identity(record: Any) -> Any:
    """Which device memory an exported record opens: its allocation's handle and offset."""
    if not isinstance(record, dict):
        return id(record)  # not a record at all: refused when parsed
    return (str(record.get("handle")), str(record.get("storage_offset_bytes")))


@dataclass
class IPCUpdateInfo(ParamListUpdateInfo):
    """Per-round metadata: core's parameter list, the trainer, the round's number."""

    trainer_id: str = ""
    round_id: int = 0


SEAL_BYTES = 128  # the seal at the start of every staging buffer; the bucket bytes follow
_SEAL_MAGIC = int.from_bytes(b"wt-seal1", "little", signed=True)
# The seal's words after magic, nonce and index: what the handshake must repeat exactly.
_SEALED_FIELDS = (
    "packed_num_buffers",
    "packed_buffer_size_bytes",
    "packed",
    "packed_min_bucket_bytes",
    "verify",
    "trainer_id",
)
_SEAL = struct.Struct(f"<{3 + len(_SEALED_FIELDS)}q")


def _id_digest(trainer_id: str) -> int:
    raw = hashlib.blake2b(trainer_id.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


@dataclass(frozen=True)
class StagingSeal:
    """The seal of one staging: what the trainer writes into the first `SEAL_BYTES` of
    each buffer, and what a worker expects there.

    Little-endian int64 words: magic, `nonce`, the buffer's index, then the
    values of `_SEALED_FIELDS` (`trainer_id` as a 64-bit digest). The trainer
    draws `nonce` per staging and tells each worker on its control link; the
    worker builds its expectation from the handshake and that nonce, and
    `check` refuses a buffer whose seal differs, naming the entry.
    """

    wire: WireParams
    trainer_id: str
    nonce: int

    def _words(self, index: int) -> tuple[int, ...]:
        w = self.wire
        return (
            _SEAL_MAGIC,
            self.nonce,
            index,
            w.packed_num_buffers,
            w.packed_buffer_size_bytes,
            int(w.packed),
            w.packed_min_bucket_bytes,
            int(w.verify),
            _id_digest(self.trainer_id),
        )

    def encode(self, index: int) -> bytes:
        """The `SEAL_BYTES` of buffer `index`'s seal."""
        return _SEAL.pack(*self._words(index)).ljust(SEAL_BYTES, b"\0")

    def check(self, sealed: bytes, index: int, entry: str) -> None:
        """Refuse (`ValueError` naming `entry`, the handshake's field for buffer `index`)
        a buffer whose seal `sealed` is not this staging's seal of buffer `index`."""
        got = _SEAL.unpack_from(sealed)
        want = self._words(index)
        where = f"init_info: field {entry!r}"
        if got[0] != _SEAL_MAGIC:
            raise ValueError(f"{where}: the buffer carries no wt staging seal")
        if got[1] != want[1]:
            raise ValueError(
                f"{where}: the buffer belongs to another staging, not to the one of the "
                "trainer on 'control_path'"
            )
        if got[2] != index:
            raise ValueError(
                f"{where}: the buffer is staging buffer {got[2]}, not {index} (a repeated or "
                "reordered entry)"
            )
        for name, theirs, ours in zip(_SEALED_FIELDS, got[3:], want[3:], strict=True):
            if theirs == ours:
                continue
            if name == "trainer_id":
                raise ValueError(
                    f"init_info: field 'trainer_id' is not the trainer that made the staging "
                    f"(the seal of {entry})"
                )
            raise ValueError(
                f"init_info: field {name!r} is {ours}, but the trainer made the staging with "
                f"{theirs} (the seal of {entry})"
            )


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
