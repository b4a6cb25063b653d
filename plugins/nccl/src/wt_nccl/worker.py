"""Worker side of the `nccl` backend: receive the trainer's buckets, load them.

`receive_weights` walks the same bucket plan as the trainer. Each bucket
lands in rotating buffer `k % n` and is loaded by core's `LoadPipeline`
while the next one is received (on CPU the load into a live model costs more
than the wire). Tensors are views into the buffer when the buffer-reuse rule
allows it and copies otherwise (`Unpacker`'s `view_horizon`).

With `verify`, each bucket's digests follow its bytes; the pipeline checks the
bucket against them before loading it (`LoadPipeline.received`).

Before sizing any receive, each bucket's header is checked against the
worker's plan: an update info that is not the trainer's (its declared
parameter list differs) is refused naming the field, after the rest of the
round has been received as the trainer's headers size it, so the group stays
in step and the model keeps its weights.

Failure: a load that fails, or a bucket whose bytes differ from the trainer's
digests, makes the pipeline drain the rest of the round (the group stays
aligned), then the round raises; an abort notice from the trainer
raises at once. Either way core's transaction rolls the model back. Anything
else on the wire tears the group down (`GroupChannel.on_wire`); the next start
is refused for want of a group, and the trainer re-forms it (`reconnect`).
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
    RotatingBuffers,
    Unpacker,
)
from wt_nccl.protocol import (
    HEADER_LEN,
    HEADER_OK,
    Header,
    NCCLUpdateInfo,
    NCCLWorkerInitInfo,
    TrainerAbortedError,
    WireParams,
    plan_for,
)

__all__ = ["NCCLWorkerEngine"]

_MAX_PIECES = 1 << 22  # more tensors in one bucket than any model has


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
        self._buffers: RotatingBuffers | None = None

    def init_transfer_engine(self, init_info: NCCLWorkerInitInfo) -> None:
        """Record the trainer's wire parameters and join its group (replacing an old one).

        The group (and the receive buffers) live where the trainer's transport
        puts them: on this worker's GPU for NCCL, on CPU for gloo (see
        `join_group`); the loader copies into the model.
        """
        self.channel.drop("the last init_weight_transfer_engine failed")
        self.wire = init_info.wire
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
        plan = plan_for(metas, wire)
        declared = self.layouts.digests(update_info)
        loader = self.loader
        with self.channel.on_wire("receiving a round") as group:
            unpacker = Unpacker(plan, group.device, buffers if wire.packed else None)
            pipeline = LoadPipeline(loader.load, len(buffers), group.timeout_s, name="wt-nccl-load")
            try:
                for k, bucket in enumerate(plan.buckets):
                    pipeline.before_receive(k)
                    head = self._header(group, k)
                    if head.status != HEADER_OK:
                        raise AlignedFailure(
                            TrainerAbortedError(
                                f"the trainer aborted the update at bucket {k} of "
                                f"{len(plan.buckets)}; see the trainer's error"
                            )
                        )
                    problem = head.disagreement(plan, declared)
                    if problem is not None:
                        self._drain(group, head, wire)
                        raise AlignedFailure(ValueError(problem))
                    if wire.packed:
                        data = buffers.get(k, bucket.nbytes)
                    else:
                        data = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
                    group.wait(group.broadcast(data), f"bucket {k}")
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

    def _header(self, group: StatelessGroup, k: int) -> Header:
        """Receive the header of bucket `k`; a header out of sequence tears the group down."""
        raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=group.device)
        group.wait(group.broadcast(raw), f"the header of bucket {k}")
        head = Header.parse([int(v) for v in raw.tolist()])
        if head.bucket != k:
            raise RuntimeError(f"wire out of step: expected bucket {k}, got {head.bucket}")
        return head

    def _drain(self, group: StatelessGroup, head: Header, wire: WireParams) -> None:
        """Receive the rest of the trainer's round, from `head`'s bucket on, as the
        trainer's headers size it, and discard it: the group stays in step. A size
        no honest trainer sends (over a staging buffer, or the host's memory when
        unpacked) tears the group down instead."""
        limit = wire.packed_buffer_size_bytes if wire.packed else host_memory_bytes() // 2
        while True:
            if not (0 <= head.nbytes <= limit and 0 <= head.pieces <= _MAX_PIECES):
                raise RuntimeError(
                    f"bucket {head.bucket}: the trainer's header declares {head.nbytes} bytes "
                    f"in {head.pieces} pieces, over the limit of {limit} bytes"
                )
            scratch = torch.empty(head.nbytes, dtype=torch.uint8, device=group.device)
            group.wait(group.broadcast(scratch), f"bucket {head.bucket} (drained)")
            if wire.verify:
                sums = torch.empty(head.pieces, 2, dtype=DIGEST_DTYPE, device=group.device)
                group.wait(group.broadcast(sums), f"the digests of bucket {head.bucket} (drained)")
            if head.bucket + 1 >= head.buckets:
                return
            head = self._header(group, head.bucket + 1)
            if head.status != HEADER_OK:
                return  # the trainer ended the round itself

    def shutdown(self) -> None:
        self.channel.close()
        if self._buffers is not None:
            self._buffers.release()
