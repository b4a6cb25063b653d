"""The two data planes of `ipc`: shared-memory segments (CPU) and CUDA IPC buffers (GPU).

Either way the staging is `packed_num_buffers` `uint8` buffers of
`packed_buffer_size_bytes`, allocated once per attachment of the workers and
mapped once per worker attachment; the round writes and reads them through the
same control protocol (`protocol`). Each buffer is preceded in its memory by
the staging's seal (`StagingSeal`, `SEAL_BYTES`): `slots` are the bytes after
it.

Trainer: `TrainerStaging.create(plane, count, nbytes, device, readers,
seal)` writes every buffer's seal; `fields()` are the handshake's buffer
fields; `attached()` runs once every worker has mapped the buffers (shared
memory: the names are unlinked, so nothing is left in /dev/shm whichever
process dies later); `publish()` makes the bytes written so far visible to the
workers (CUDA: waits for the copies).

Worker: `WorkerStaging.open(info, reader, peer_pid, peer_uid, seal)` checks
every field before it maps the buffer it names, and every buffer's seal
against `seal` once it is mapped, before any byte of it is read as a bucket;
each refusal is a `ValueError` naming the entry. `reads_done()` waits until
the loads issued so far have read their views (CUDA: a device synchronize)
before a buffer is released.

A CUDA record (`CudaRecord`) is what `UntypedStorage._share_cuda_` returns,
with the byte strings in base64 and the exporter's device by UUID, so the
payload is JSON; the worker opens it on its own index for that UUID.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.backend import parse_payload, payload_of
from wt_ipc.protocol import SEAL_BYTES, StagingSeal
from wt_kits.colocated import SharedSegment
from wt_kits.stream import RotatingBuffers

__all__ = ["TrainerStaging", "WorkerStaging", "CudaRecord", "device_uuid", "local_cuda_index"]


@dataclass
class CudaRecord:
    """One exported CUDA buffer, JSON-safe (byte strings as standard base64)."""

    device_uuid: str
    handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_cuda_index(uuid: str, *, field: str) -> int:
    """This process's index of the GPU with `uuid`; `ValueError` listing the visible ones."""
    visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in visible:
        raise ValueError(
            f"field {field!r}: GPU {uuid} is not visible to this worker (visible: "
            f"{', '.join(visible) or 'none'})"
        )
    return visible.index(uuid)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, *, field: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"field {field!r} is not standard base64: {e}") from None


def _export(buffer: torch.Tensor) -> CudaRecord:
    (_, handle, size, offset, ref_handle, ref_offset, event, sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    return CudaRecord(
        device_uuid(buffer.device.index),
        _b64(handle),
        int(size),
        int(offset),
        _b64(ref_handle),
        int(ref_offset),
        _b64(event or b""),
        bool(sync),
    )


def _open_cuda(record: CudaRecord, nbytes: int, *, field: str) -> torch.Tensor:
    index = local_cuda_index(record.device_uuid, field=f"{field}.device_uuid")
    if record.storage_size_bytes < nbytes or record.storage_offset_bytes < 0:
        raise ValueError(
            f"field {field!r}: the exported storage holds {record.storage_size_bytes} bytes "
            f"(offset {record.storage_offset_bytes}); a buffer needs {nbytes}"
        )
    event = _unb64(record.event_handle, field=f"{field}.event_handle")
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        _unb64(record.handle, field=f"{field}.handle"),
        record.storage_size_bytes,
        record.storage_offset_bytes,
        _unb64(record.ref_counter_handle, field=f"{field}.ref_counter_handle"),
        record.ref_counter_offset,
        event or None,
        record.event_sync_required,
    )
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    return out.set_(storage, 0, (nbytes,), (1,))


def _write_seal(buffer: torch.Tensor, seal: StagingSeal, index: int) -> None:
    sealed = torch.frombuffer(bytearray(seal.encode(index)), dtype=torch.uint8)
    buffer[:SEAL_BYTES].copy_(sealed)


def _read_seal(buffer: torch.Tensor) -> bytes:
    return bytes(buffer[:SEAL_BYTES].cpu().numpy().tobytes())


class TrainerStaging:
    """The trainer's staging buffers; see the module docstring."""

    def __init__(
        self,
        plane: str,
        slots: list[torch.Tensor],
        segments: list[SharedSegment],
        records: list[list[CudaRecord]],
    ) -> None:
        self.plane = plane
        self.slots = slots
        self._segments = segments
        self._records = records

    @classmethod
    def create(
        cls,
        plane: str,
        count: int,
        nbytes: int,
        device: torch.device,
        readers: int,
        seal: StagingSeal,
    ) -> TrainerStaging:
        """`count` sealed buffers of `nbytes` on `plane`, CUDA ones exported once per reader."""
        if plane == "shm":
            segments: list[SharedSegment] = []
            try:
                for i in range(count):
                    segment = SharedSegment.create(SEAL_BYTES + nbytes)
                    segments.append(segment)
                    _write_seal(segment.tensor, seal, i)
            except BaseException:
                for segment in segments:
                    segment.close()
                raise
            return cls(plane, [s.tensor[SEAL_BYTES:] for s in segments], segments, [])
        buffers = [
            torch.empty(SEAL_BYTES + nbytes, dtype=torch.uint8, device=device) for _ in range(count)
        ]
        for i, buffer in enumerate(buffers):
            _write_seal(buffer, seal, i)
        torch.cuda.current_stream(device).synchronize()  # sealed before any worker opens one
        records = [[_export(buffer) for buffer in buffers] for _ in range(readers)]
        return cls(plane, [b[SEAL_BYTES:] for b in buffers], [], records)

    def fields(self) -> dict[str, Any]:
        if self.plane == "shm":
            return {"segment_names": [s.name for s in self._segments]}
        return {"cuda_buffers": [[payload_of(r) for r in rs] for rs in self._records]}

    def attached(self) -> None:
        for segment in self._segments:
            segment.unlink()

    def publish(self) -> None:
        if self.plane == "cuda":
            torch.cuda.current_stream(self.slots[0].device).synchronize()

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments, self.slots, self._records = [], [], []
        if self.plane == "cuda":
            torch.cuda.ipc_collect()


class WorkerStaging:
    """A worker's mapping of the trainer's staging buffers; see the module docstring."""

    def __init__(
        self, plane: str, slots: list[torch.Tensor], segments: list[SharedSegment]
    ) -> None:
        self.plane = plane
        self.slots = slots
        self._segments = segments
        # the slots as rotating buffers: their piece views are made once per layout
        self.rotating = RotatingBuffers.over(slots)

    @property
    def device(self) -> torch.device:
        return self.slots[0].device

    @classmethod
    def open(
        cls, info: Any, reader: int, *, peer_pid: int, peer_uid: int, seal: StagingSeal
    ) -> WorkerStaging:
        """Map `info`'s buffers as worker `reader` of the trainer `peer_pid` / `peer_uid`,
        each checked against `seal` (the staging the trainer on the link made)."""
        nbytes = SEAL_BYTES + info.packed_buffer_size_bytes
        if info.plane == "shm":
            if peer_pid != info.trainer_pid:
                raise ValueError(
                    f"init_info: field 'trainer_pid' is {info.trainer_pid}, but process "
                    f"{peer_pid} answers on 'control_path'"
                )
            segments: list[SharedSegment] = []
            try:
                for i, name in enumerate(info.segment_names):
                    entry = f"segment_names[{i}]"
                    segment = SharedSegment.attach(
                        name, nbytes, owner_pid=peer_pid, owner_uid=peer_uid, field=entry
                    )
                    segments.append(segment)
                    seal.check(_read_seal(segment.tensor), i, entry)
            except BaseException:
                for segment in segments:
                    segment.close()
                raise
            return cls("shm", [s.tensor[SEAL_BYTES:] for s in segments], segments)
        if not torch.cuda.is_available():
            raise ValueError("init_info: field 'plane' is 'cuda', but this worker has no CUDA")
        if reader >= len(info.cuda_buffers):
            raise ValueError(
                f"init_info: field 'cuda_buffers' has exports for {len(info.cuda_buffers)} "
                f"workers; this is worker {reader} (set num_workers in the trainer's init info)"
            )
        slots = []
        for i, raw in enumerate(info.cuda_buffers[reader]):
            entry = f"cuda_buffers[{reader}][{i}]"
            record = parse_payload(CudaRecord, raw, f"init_info: field {entry!r}")
            buffer = _open_cuda(record, nbytes, field=entry)
            seal.check(_read_seal(buffer), i, entry)
            slots.append(buffer[SEAL_BYTES:])
        return cls("cuda", slots, [])

    def reads_done(self) -> None:
        if self.plane == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.slots = []
        self.rotating.release()
        for segment in self._segments:
            segment.close()
        self._segments = []
