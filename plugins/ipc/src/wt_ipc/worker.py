"""Worker side of the `ipc` backend: load each bucket from views into the trainer's staging.

`init_transfer_engine` connects to the trainer's control socket (the kernel
names the process at the other end), reads the staging's nonce from it, maps
the staging buffers after checking every field against that process and every
buffer's seal against the handshake and the nonce (`WorkerStaging.open`), and
says hello. Only then does the new attachment replace the one this engine
had: a refused init leaves a working attachment exactly as it was.

`start_weight_update` refuses a round without a live attachment with core's
`Refusal.NO_CONNECTION` message (a restarted engine, one whose link closed), which makes
the trainer attach every worker again (`reconnect`) and start once more.

`receive_weights` walks the same layout as the trainer. It first compares
the update info with the trainer's layout digests (`LAYOUT` frames): an
update info altered on its way is refused naming the field, before a byte is
loaded, in step with the trainer. Then for bucket `k` it waits for
`READY(k)`, hands views into buffer `k % n` to core's `LoadPipeline` (copies
where the buffer-reuse rule forbids views, as for any bucketed backend) and
releases each buffer as soon as nothing refers to it.
With `verify`, the pipeline first checks the bucket against the digests the
trainer left in the buffer's digest room (a mismatch drains the round).
A load that fails drains the round (the worker keeps releasing, so the
trainer finishes); an `ABORT` from the trainer, or its death (its socket
closes), ends the round at once. Either way core's transaction rolls the
model back; when the link is gone the worker also unmaps the staging.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from weight_transfer.backend import (
    PARAM_LIST_FIELDS,
    AlignedFailure,
    LayoutMemo,
    WeightTransferEngine,
    check_declared,
)
from wt_ipc.planes import WorkerStaging
from wt_ipc.protocol import (
    ABORT,
    HELLO,
    LAYOUT,
    READY,
    SEAL,
    IPCUpdateInfo,
    IPCWorkerInitInfo,
    StagingSeal,
    TrainerAbortedError,
    digest_room,
    plan_for,
)
from wt_kits.channel import GroupChannel
from wt_kits.colocated import RELEASED, Frame, LinkClosed, LocalLink, connect_local
from wt_kits.stream import BucketPlan, LoadFailed, LoadPipeline, Unpacker, WireParams

__all__ = ["IPCWorkerEngine"]


class IPCWorkerEngine(WeightTransferEngine[IPCWorkerInitInfo, IPCUpdateInfo]):
    init_info_cls = IPCWorkerInitInfo
    update_info_cls = IPCUpdateInfo

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device | str, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: GroupChannel[LocalLink] = GroupChannel(
            "ipc", remedy="the trainer attaches its workers again at its next round"
        )
        self.wire: WireParams | None = None
        self.layouts = LayoutMemo()  # the last round's decoded parameter list
        self.staging: WorkerStaging | None = None
        self.timeout_s = 300.0
        self.last_round = 0

    def init_transfer_engine(self, init_info: IPCWorkerInitInfo) -> None:
        """Attach to the trainer's staging, replacing a previous attachment only once the
        new one is connected, mapped, checked and greeted (a refusal leaves the old one)."""
        self._detach_if_trainer_left()
        link, staging = self._attach(init_info)
        self._release_staging()
        self.wire, self.staging = init_info.wire, staging
        self.timeout_s, self.last_round = init_info.timeout_s, 0
        self.channel.connect(link)

    def _attach(self, init_info: IPCWorkerInitInfo) -> tuple[LocalLink, WorkerStaging]:
        """A new link and mapped staging, hello sent; on any failure both are released."""
        link = connect_local(init_info.control_path, init_info.timeout_s)
        staging: WorkerStaging | None = None
        index = self.position.global_index
        try:
            first = link.recv(init_info.timeout_s, "the trainer's staging nonce")
            if first.kind != SEAL:
                raise RuntimeError(
                    f"the trainer on 'control_path' sent {first} before its staging nonce"
                )
            seal = StagingSeal(init_info.wire, init_info.trainer_id, first.value)
            staging = WorkerStaging.open(
                init_info, index, peer_pid=link.peer_pid, peer_uid=link.peer_uid, seal=seal
            )
            link.send(Frame(HELLO, -1, index, os.getpid()))
        except BaseException:
            if staging is not None:
                staging.close()
            link.close()
            raise
        return link, staging

    def start_weight_update(self) -> None:
        """Refuse a round without a live attachment (`Refusal.NO_CONNECTION`: the trainer attaches
        every worker again, then starts once more); nothing else beyond core's
        transaction (the loader has begun)."""
        self._detach_if_trainer_left()
        self.channel.require()

    def receive_weights(self, update_info: IPCUpdateInfo) -> None:
        wire, staging = self.wire, self.staging
        if wire is None or staging is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        round_id = update_info.round_id
        if round_id <= self.last_round:
            raise ValueError(
                f"update_info: field 'round_id' is {round_id}, but round {self.last_round} "
                "already ran on this link (a stale or replayed update)"
            )
        metas = self.layouts.metas(update_info)
        check_declared(metas, self.model, what="update_info")
        plan = plan_for(metas, wire)
        mapped = min(slot.numel() for slot in staging.slots)
        if plan.max_bucket_bytes > mapped:  # every view must lie inside what was mapped
            raise ValueError(
                f"update_info: the layout needs buffers of {plan.max_bucket_bytes} bytes, "
                f"the mapped staging holds {mapped}"
            )
        self.last_round = round_id
        try:
            with self.channel.on_wire("receiving a round") as link:
                self._receive_round(link, plan, update_info, staging)
        finally:
            if not self.channel.connected:  # the link is gone, and with it the trainer's staging
                self._release_staging()

    def _receive_round(
        self, link: LocalLink, plan: BucketPlan, update_info: IPCUpdateInfo, staging: WorkerStaging
    ) -> None:
        round_id = update_info.round_id
        # Before any release: a refused round stops the trainer at its window, not after
        # it has queued every bucket's frame on this link.
        self._check_layout(link, round_id, update_info)
        slots = staging.slots
        released = 0

        def release(upto: int) -> None:
            nonlocal released
            if upto > released:
                staging.reads_done()
                link.send(Frame(RELEASED, round_id, 0, upto))
                released = upto

        unpacker = Unpacker(plan, staging.device, staging.rotating)
        assert self.wire is not None
        room = digest_room(self.wire) if self.wire.verify else None
        pipeline = LoadPipeline(self.loader.load, len(slots), self.timeout_s, name="wt-ipc-load")
        try:
            for k, bucket in enumerate(plan.buckets):
                pipeline.before_receive(k)
                release(k - len(slots) + 1)  # the reuse rule frees bucket k - n by now
                frame = self._next_frame(link, round_id, f"bucket {k}")
                if frame.kind == ABORT:
                    raise _aborted(f"at bucket {k} of {len(plan.buckets)}")
                if (frame.kind, frame.index, frame.value) != (READY, k, bucket.nbytes):
                    raise RuntimeError(
                        f"control link out of step: expected READY of bucket {k} "
                        f"({bucket.nbytes} bytes), got {frame}"
                    )
                slot = slots[k % len(slots)]
                digests = None
                if room is not None and not pipeline.draining:  # a copy: the check runs later
                    digests = room.view(slot, len(bucket.pieces)).clone()
                pipeline.received(k, slot[: bucket.nbytes], unpacker, digests)
            try:
                pipeline.finish()
            except LoadFailed as failed:
                raise AlignedFailure(failed) from failed
        finally:
            pipeline.close()
            with contextlib.suppress(LinkClosed):
                release(len(plan.buckets))

    def _check_layout(self, link: LocalLink, round_id: int, update_info: IPCUpdateInfo) -> None:
        """Refuse, in step with the trainer (`AlignedFailure`), an update info whose
        parameter list is not the one the trainer declared (its `LAYOUT` frames), naming
        the first field that differs; nothing has been loaded yet."""
        theirs = []
        for i, name in enumerate(PARAM_LIST_FIELDS):
            frame = self._next_frame(link, round_id, f"the layout digest of {name!r}")
            if frame.kind == ABORT:
                raise _aborted("before its first bucket")
            if (frame.kind, frame.index) != (LAYOUT, i):
                raise RuntimeError(
                    f"control link out of step: expected the layout digest of {name!r}, got {frame}"
                )
            theirs.append(frame.value)
        ours = self.layouts.digests(update_info)
        for name, mine, trainer in zip(PARAM_LIST_FIELDS, ours, theirs, strict=True):
            if mine != trainer:
                raise AlignedFailure(
                    ValueError(
                        f"update_info: field {name!r} is not what the trainer declared for "
                        f"round {round_id} (digest {mine}, the trainer's {trainer}): the "
                        "update info was altered on its way; nothing was loaded"
                    )
                )

    def _next_frame(self, link: LocalLink, round_id: int, what: str) -> Frame:
        """The next frame of `round_id`, skipping those a round that ended early left."""
        while True:
            frame = link.recv(self.timeout_s, f"the trainer's notice of {what}")
            if frame.round_id == round_id:
                return frame
            if frame.round_id > round_id:
                raise RuntimeError(
                    f"the trainer is at round {frame.round_id}, this update is for round {round_id}"
                )

    def _release_staging(self) -> None:
        """Unmap the trainer's staging (a mapping still viewed goes with its last view)."""
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def _detach_if_trainer_left(self) -> None:
        """Release an attachment whose trainer closed its end of the link (a working
        attachment is kept)."""
        link = self.channel.group
        if link is not None and not link.peer_alive():
            self._detach("the trainer closed the control link")

    def _detach(self, reason: str) -> None:
        self.channel.drop(reason)
        self._release_staging()

    def shutdown(self) -> None:
        self.channel.close()
        self._release_staging()


def _aborted(where: str) -> AlignedFailure:
    return AlignedFailure(
        TrainerAbortedError(f"the trainer aborted the update {where}; see the trainer's error")
    )
