"""Worker side of the `nccl` backend: receive the trainer's buckets, load them.

`receive_weights` walks the same bucket plan as the trainer. Each bucket
lands in rotating buffer `k % n` and is loaded by core's `LoadPipeline`
while the next one is received (on CPU the load into a live model costs more
than the wire). Tensors are views into the buffer when the buffer-reuse rule
allows it and copies otherwise (`Unpacker`'s `view_horizon`).

With `verify`, each bucket's digests follow its bytes; the pipeline checks the
bucket against them before loading it (`LoadPipeline.received`).

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
    DIGEST_DTYPE,
    AlignedFailure,
    GroupChannel,
    LoadFailed,
    LoadPipeline,
    RotatingBuffers,
    StatelessGroup,
    Unpacker,
    WeightTransferEngine,
    check_declared,
    join_group,
)
from wt_nccl.protocol import (
    HEADER_OK,
    NCCLUpdateInfo,
    NCCLWorkerInitInfo,
    TrainerAbortedError,
    WireParams,
    plan_for,
)

__all__ = ["NCCLWorkerEngine"]


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
        self._buffers: RotatingBuffers | None = None

    def init_transfer_engine(self, init_info: NCCLWorkerInitInfo) -> None:
        """Record the trainer's wire parameters and join its group (replacing an old one).

        The group (and the receive buffers) live where the trainer's transport
        puts them: on this worker's GPU for NCCL, on CPU for gloo (see
        `join_group`); the loader copies into the model.
        """
        self.channel.admit(init_info.trainer_id, replace=init_info.replace)
        self.channel.drop("the last init_weight_transfer_engine failed")
        self.wire = init_info.wire
        group = join_group(init_info, self.position, self.device)
        self.channel.connect(group, holder=init_info.trainer_id)
        buffers = self._buffers
        if buffers is None or (len(buffers), buffers.device) != (
            self.wire.packed_num_buffers,
            group.device,
        ):
            self._buffers = RotatingBuffers(self.wire.packed_num_buffers, group.device)

    def start_weight_update(self) -> None:
        """Refuse a round without a group (a restarted engine, one whose group was
        torn down): the trainer re-forms the group and starts again."""
        self.channel.require()

    def receive_weights(self, update_info: NCCLUpdateInfo) -> None:
        wire, buffers = self.wire, self._buffers
        if wire is None or buffers is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        self.channel.check_holder(update_info.trainer_id)
        check_declared(update_info.metas, self.model, what="update_info")
        plan = plan_for(update_info.metas, wire)
        loader = self.loader
        with self.channel.on_wire("receiving a round") as group:
            unpacker = Unpacker(plan, group.device)
            pipeline = LoadPipeline(loader.load, len(buffers), group.timeout_s, name="wt-nccl-load")
            head = torch.empty(2, dtype=torch.int64, device=group.device)
            try:
                for k, bucket in enumerate(plan.buckets):
                    pipeline.before_receive(k)
                    group.wait(group.broadcast(head), f"the header of bucket {k}")
                    seq, status = (int(v) for v in head.tolist())
                    if seq != k:
                        raise RuntimeError(f"wire out of step: expected bucket {k}, got {seq}")
                    if status != HEADER_OK:
                        raise AlignedFailure(
                            TrainerAbortedError(
                                f"the trainer aborted the update at bucket {k} of "
                                f"{len(plan.buckets)}; see the trainer's error"
                            )
                        )
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

    def finish_weight_update(self) -> None:
        """Nothing beyond core's transaction (the loader commits)."""

    def shutdown(self) -> None:
        self.channel.close()
        if self._buffers is not None:
            self._buffers.release()
