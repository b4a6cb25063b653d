"""Worker side of the `nccl` backend: receive the trainer's buckets, load them.

`receive_weights` walks the same bucket plan as the trainer (the wire format
is in `wt_nccl.protocol`). Each bucket lands in rotating buffer `k % n` and
is loaded by core's `LoadPipeline` while the next one is received (on CPU the
load into a live model costs more than the wire), once its status says the
trainer produced it. Tensors are views into the buffer when the buffer-reuse
rule allows it and copies otherwise (`Unpacker`'s `view_horizon`).

With `verify`, each bucket's digests follow its bytes; the pipeline checks the
bucket against them before loading it (`LoadPipeline.received`).

Before sizing any other receive, the round header and the trainer's layout
are checked against the worker's plan: an update info that is not the
trainer's (its declared parameter list differs) is refused naming the field,
after the rest of the round has been received as the trainer's layout sizes
it, so the group stays in step and the model keeps its weights.

Failure: a load that fails, or a bucket whose bytes differ from the trainer's
digests, makes the pipeline drain the rest of the round (the group stays
aligned), then the round raises; a bucket whose status is `STATUS_ABORT`
raises at once, before anything of it is loaded. Either way core's
transaction rolls the model back. Anything else on the wire tears the group
down (`GroupChannel.on_wire`); the next start is refused for want of a group,
and the trainer re-forms it (`reconnect`).
"""

from __future__ import annotations

from typing import Any

import torch

from weight_transfer.backend import (
    AlignedFailure,
    LayoutMemo,
    WeightTransferEngine,
    check_declared,
    host_memory_bytes,
)
from wt_kits.channel import GroupChannel
from wt_kits.group import StatelessGroup, join_group
from wt_kits.stream import (
    DIGEST_DTYPE,
    LoadFailed,
    LoadPipeline,
    PlanCache,
    RotatingBuffers,
    Unpacker,
)
from wt_nccl.protocol import (
    LAYOUT_COLUMNS,
    ROUND_HEADER_LEN,
    STATUS_LEN,
    STATUS_OK,
    NCCLUpdateInfo,
    NCCLWorkerInitInfo,
    RoundHeader,
    TrainerAbortedError,
    WireParams,
    is_solo,
    message_bytes,
    plan_for,
    tail_of,
)

__all__ = ["NCCLWorkerEngine"]

_MAX_PIECES = 1 << 22  # more tensors in one bucket, or buckets in one round, than any model has


class NCCLWorkerEngine(WeightTransferEngine[NCCLWorkerInitInfo, NCCLUpdateInfo]):
    init_info_cls = NCCLWorkerInitInfo
    update_info_cls = NCCLUpdateInfo

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device | str, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: GroupChannel[StatelessGroup] = GroupChannel(
            "nccl", remedy="the trainer re-forms the group at its next round (or run trainer_init)"
        )
        self.wire: WireParams | None = None
        self.layouts = LayoutMemo()  # the last round's decoded parameter list
        self.plan_for = PlanCache(lambda metas: plan_for(metas, self._wire()))
        self._buffers: RotatingBuffers | None = None
        self._small: dict[str, torch.Tensor] = {}

    def init_transfer_engine(self, init_info: NCCLWorkerInitInfo) -> None:
        """Record the trainer's wire parameters and join its group (replacing an old one).

        The group (and the receive buffers) live where the trainer's transport
        puts them: on this worker's GPU for NCCL, on CPU for gloo (see
        `join_group`); the loader copies into the model.
        """
        self.channel.drop("the last init_weight_transfer_engine failed")
        self.wire = init_info.wire
        self.plan_for = PlanCache(lambda metas: plan_for(metas, self._wire()))
        group = join_group(init_info, self.position, self.device)
        self.channel.connect(group)
        buffers = self._buffers
        if buffers is None or (len(buffers), buffers.device) != (
            self.wire.packed_num_buffers,
            group.device,
        ):
            self._buffers = RotatingBuffers(self.wire.packed_num_buffers, group.device)

    def receive_weights(self, update_info: NCCLUpdateInfo) -> None:
        wire, buffers = self.wire, self._buffers
        if wire is None or buffers is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        metas = self.layouts.metas(update_info)
        check_declared(metas, self.model, what="update_info")
        plan = self.plan_for(metas)
        declared = self.layouts.digests(update_info)
        loader = self.loader
        with self.channel.on_wire("receiving a round") as group:
            head, rows = self._round_header(group)
            problem = head.disagreement(rows, plan, declared)
            if problem is not None:
                self._drain(group, rows, wire)
                raise AlignedFailure(ValueError(problem))
            unpacker = Unpacker(plan, group.device, buffers if wire.packed else None)
            pipeline = LoadPipeline(loader.load, len(buffers), group.timeout_s, name="wt-nccl-load")
            try:
                for k, bucket in enumerate(plan.buckets):
                    pipeline.before_receive(k)
                    solo = is_solo(bucket)
                    data = self._bucket(
                        group, k, bucket.nbytes, solo, buffers if wire.packed else None
                    )
                    if data is None:
                        raise AlignedFailure(
                            TrainerAbortedError(
                                f"the trainer aborted the update at bucket {k} of "
                                f"{len(plan.buckets)}; see the trainer's error"
                            )
                        )
                    digests = None
                    if wire.verify:  # received even while draining: the wire stays in step
                        digests = torch.empty(
                            len(bucket.pieces), 2, dtype=DIGEST_DTYPE, device=group.device
                        )
                        group.wait(group.broadcast(digests), f"the digests of bucket {k}")
                    pipeline.received(k, data, unpacker, digests)
                try:
                    pipeline.finish()
                except LoadFailed as failed:
                    raise AlignedFailure(failed) from failed
            finally:
                pipeline.close()

    def _round_header(self, group: StatelessGroup) -> tuple[RoundHeader, list[list[int]]]:
        """Receive the round header and the trainer's layout; a bucket count no honest
        trainer sends tears the group down."""
        raw = self._scratch("header", (ROUND_HEADER_LEN,), group.device)
        group.wait(group.broadcast(raw), "the round header")
        head = RoundHeader.parse(raw.tolist())
        if not 0 <= head.buckets <= _MAX_PIECES:
            raise RuntimeError(f"the round header declares {head.buckets} buckets")
        if head.buckets == 0:
            return head, []
        layout = self._scratch("layout", (head.buckets, LAYOUT_COLUMNS), group.device)
        group.wait(group.broadcast(layout), "the round's layout")
        return head, layout.tolist()

    def _bucket(
        self,
        group: StatelessGroup,
        k: int,
        nbytes: int,
        solo: bool,
        buffers: RotatingBuffers | None,
    ) -> torch.Tensor | None:
        """Receive bucket `k` (`nbytes` bytes, into `buffers` when packed): its bytes, or
        None when the trainer aborted the round at `k`."""
        if solo:  # its status first, then its bytes unless the trainer aborted
            status = self._scratch("status", (STATUS_LEN,), group.device)
            group.wait(group.broadcast(status), f"the status of bucket {k}")
            if not _status_ok(status, k):
                return None
        size = message_bytes(nbytes, solo)
        if buffers is not None:
            message = buffers.get(k, size)
        else:
            message = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.wait(group.broadcast(message), f"bucket {k}")
        if not solo and not _status_ok(tail_of(message, nbytes), k):
            return None
        return message[:nbytes]

    def _drain(self, group: StatelessGroup, rows: list[list[int]], wire: WireParams) -> None:
        """Receive the trainer's round as its layout `rows` size it, and discard it: the
        group stays in step. A size no honest trainer sends (over a staging buffer, or
        the host's memory when unpacked) tears the group down instead."""
        limit = wire.packed_buffer_size_bytes if wire.packed else host_memory_bytes() // 2
        for k, (nbytes, pieces, solo) in enumerate(rows):
            if not (0 <= nbytes <= limit and 0 <= pieces <= _MAX_PIECES and solo in (0, 1)):
                raise RuntimeError(
                    f"bucket {k}: the trainer's layout declares {nbytes} bytes in {pieces} "
                    f"pieces (solo: {solo}), over the limit of {limit} bytes"
                )
            if self._bucket(group, k, nbytes, bool(solo), None) is None:
                return  # the trainer ended the round itself
            if wire.verify:
                sums = torch.empty(pieces, 2, dtype=DIGEST_DTYPE, device=group.device)
                group.wait(group.broadcast(sums), f"the digests of bucket {k} (drained)")

    def _scratch(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A reused `int64` receive buffer for the round's small messages."""
        held = self._small.get(name)
        if held is None or held.shape != shape or held.device != device:
            held = self._small[name] = torch.empty(shape, dtype=torch.int64, device=device)
        return held

    def _wire(self) -> WireParams:
        if self.wire is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        return self.wire

    def shutdown(self) -> None:
        self.channel.close()
        if self._buffers is not None:
            self._buffers.release()


def _status_ok(status: torch.Tensor, k: int) -> bool:
    """Whether bucket `k`'s status (`int64[2]`, one host read) says OK; a status of
    another bucket means the wire is out of step (the group is torn down)."""
    index, state = status.tolist()
    if index != k:
        raise RuntimeError(f"wire out of step: expected bucket {k}, got {index}")
    return bool(state == STATUS_OK)
