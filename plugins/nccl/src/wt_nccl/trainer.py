"""Trainer side of the `nccl` backend: rank 0 broadcasts the bucket plan.

Core's `ResyncTrainerEngine` drives the round on every rank; this module is
the transmit step (the wire format is in `wt_nccl.protocol`). Per round, the
round header and the layout; then for each bucket `k` of the plan: pack it
into staging buffer `k % n` (the `SendWindow` waits until that buffer's
previous sends are done, so packing `k + 1` overlaps broadcasting `k`), write
its status tail, and broadcast it: one collective per bucket. A solo bucket
goes out from the source's own memory, its status in a broadcast before it.
If the source fails while bucket `k` is being produced, the sends in flight
are drained and `k`'s status goes out as `STATUS_ABORT` instead, so every
worker stops at the same collective and the group carries the next round.
With `verify`, a broadcast after each bucket carries the digests of its
pieces (`BucketDigests`, summed while the bytes go out).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weight_transfer.backend import (
    AlignedFailure,
    ParamMeta,
    ResyncTrainerEngine,
    TrainerInitInfo,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    param_list_digests,
    param_list_payload,
    payload_of,
)
from wt_kits.channel import GroupChannel
from wt_kits.group import GroupTrainerFields, StatelessGroup, trainer_rendezvous
from wt_kits.stream import (
    Bucket,
    BucketDigests,
    BucketPlan,
    Packer,
    PlanCache,
    RotatingBuffers,
    SendWindow,
    as_bytes,
)
from wt_kits.waits import work_future
from wt_nccl.protocol import (
    LAYOUT_COLUMNS,
    STATUS_ABORT,
    STATUS_OK,
    NCCLWorkerInitInfo,
    RoundHeader,
    WireParams,
    is_solo,
    layout_rows,
    message_bytes,
    plan_for,
    tail_of,
)

__all__ = ["NCCLTrainerInitInfo", "NCCLTrainerEngine"]


@dataclass
class NCCLTrainerInitInfo(WireParams, TrainerInitInfo, GroupTrainerFields):
    """How a trainer configures the `nccl` backend: the group (see
    `GroupTrainerFields`) and the wire parameters, which the sender ships to
    every worker in `trainer_init`."""

    backend: ClassVar[str] = "nccl"


class NCCLTrainerEngine(ResyncTrainerEngine[NCCLTrainerInitInfo]):
    init_info_cls = NCCLTrainerInitInfo
    finite_per_bucket = True

    def __init__(
        self,
        *,
        info: NCCLTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> None:
        info.validate("NCCLTrainerInitInfo")
        super().__init__(info=info, client=client, source=source)
        self.info: NCCLTrainerInitInfo = info
        self.wire = info.wire
        self.device = info.resolved_device()
        self.channel: GroupChannel[StatelessGroup] = GroupChannel(
            "nccl", remedy="call trainer_init again"
        )
        self._buffers = RotatingBuffers(self.wire.packed_num_buffers, self.device)
        self.plan_for = PlanCache(lambda metas: plan_for(metas, self.wire))

    def connect(self) -> None:
        """Host the group's rendezvous while every worker joins (their init runs
        concurrently); again, on the same port, to re-admit them."""
        info = self.info
        self.channel.close("it is being re-formed")  # frees the port for the new group
        payload = payload_of(
            NCCLWorkerInitInfo(**info.worker_group_fields(self.trainer_id), **vars(info.wire))
        )
        self.channel.connect(trainer_rendezvous(self.client, payload, info))

    def check_ready(self) -> None:
        self.channel.require()

    def update_info(self, metas: list[ParamMeta]) -> dict[str, Any]:
        return {**param_list_payload(metas), "trainer_id": self.trainer_id}

    def num_chunks(self, metas: list[ParamMeta]) -> int:
        return len(self.plan_for(metas).buckets)

    def transmit(
        self,
        metas: list[ParamMeta],
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        transfer: Transfer,
    ) -> None:
        plan = self.plan_for(metas)
        digests = BucketDigests.of_plan(plan) if self.wire.verify else None
        head, layout, statuses = self._round_tensors(plan, metas)
        with self.channel.on_wire("a broadcast") as group:
            for t, what in ((head, "the round header"), (layout, "the round's layout")):
                if t.numel():  # no layout follows a round of no buckets
                    transfer.wait(work_future(group.broadcast(t), what), what)
            window = SendWindow(self._buffers, transfer)
            packer = Packer(plan, pairs, finite=self.check_finite)
            for k, bucket in enumerate(plan.buckets):
                window.free(k)
                solo = is_solo(bucket)
                try:  # only the source can fail here: tell the workers, keep the group
                    if not solo:
                        self._buffers.get(k, message_bytes(bucket.nbytes, False))  # + the tail
                        out = packer.pack(k, self._buffers)
                    elif self.wire.packed:
                        out = packer.bytes_of(k, self._buffers)
                    else:
                        out = as_bytes(packer.whole(k).to(self.device))
                    if k == len(plan.buckets) - 1:
                        packer.exhaust()
                except Exception as error:
                    self._abort_at(k, bucket, window, transfer)
                    raise AlignedFailure(error) from error
                what = f"the broadcast of bucket {k}"
                if solo:
                    keep = [statuses[k], out]
                    sends = [work_future(group.broadcast(t), what) for t in keep]
                else:
                    message = self._buffers.get(k, message_bytes(bucket.nbytes, False))
                    tail_of(message, bucket.nbytes).copy_(statuses[k])
                    keep = [message]
                    sends = [work_future(group.broadcast(message), what)]
                if digests is not None:  # summed while the bytes go out, sent after them
                    sums = digests.of(k, out)
                    sends.append(work_future(group.broadcast(sums), f"the digests of bucket {k}"))
                    keep.append(sums)
                window.sent(k, sends, keep)
                transfer.chunk_moved(bucket.nbytes)
            if not plan.buckets:
                packer.exhaust()
            window.drain()

    def _round_tensors(
        self, plan: BucketPlan, metas: list[ParamMeta]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round header, the layout, and each bucket's OK status (`int64[buckets, 2]`),
        on the wire's device: made once per plan."""
        key = f"nccl_round:{self.device}"
        made = plan.derived.get(key)
        if made is None:
            declared = param_list_digests(param_list_payload(metas))
            head = RoundHeader(len(plan.buckets), tuple(declared)).tensor(self.device)
            rows = layout_rows(plan)
            layout = torch.tensor(rows, dtype=torch.int64, device=self.device).view(
                -1, LAYOUT_COLUMNS
            )
            statuses = torch.zeros(len(plan.buckets), 2, dtype=torch.int64, device=self.device)
            statuses[:, 0] = torch.arange(len(plan.buckets), device=self.device)
            statuses[:, 1] = STATUS_OK
            made = plan.derived[key] = (head, layout, statuses)
        return made

    def _abort_at(self, k: int, bucket: Bucket, window: SendWindow, transfer: Transfer) -> None:
        """Tell every worker the round ends at bucket `k` (after the sends in flight):
        `k`'s status as `STATUS_ABORT`, alone for a solo bucket, else as the tail of a
        message whose body no worker loads."""
        window.drain("the broadcasts before the abort notice")
        group = self.channel.require()
        status = torch.tensor([k, STATUS_ABORT], dtype=torch.int64, device=self.device)
        if is_solo(bucket):
            notice = status
        else:
            notice = self._buffers.get(k, message_bytes(bucket.nbytes, False))
            tail_of(notice, bucket.nbytes).copy_(status)
        sent = work_future(group.broadcast(notice), "the abort notice")
        transfer.wait(sent, "the abort notice", watching=False)  # they fail on purpose

    def shutdown(self) -> None:
        self.channel.close()
        self._buffers.release()
