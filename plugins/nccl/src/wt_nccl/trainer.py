"""Trainer side of the `nccl` backend: rank 0 broadcasts the bucket plan.

Core's `ResyncTrainerEngine` drives the round on every rank; this module is
the transmit step. For each bucket `k` of the plan: pack it into staging
buffer `k % n` (the `SendWindow` waits until that buffer's previous sends are
done, so packing `k + 1` overlaps broadcasting `k`), then broadcast its header
(`Header`: status OK, what the bucket holds, the digests of the declared
parameter list) and its bytes. If the source fails while bucket `k` is being
packed, the sends in flight are drained and an ABORT header goes out instead,
so every worker stops at the same collective and the group carries the next
round.
With `verify`, a third broadcast per bucket carries the digests of its pieces
(`BucketDigests`, summed while the bytes go out).
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
    BucketDigests,
    Packer,
    PlanCache,
    RotatingBuffers,
    SendWindow,
    as_bytes,
)
from wt_kits.waits import work_future
from wt_nccl.protocol import (
    HEADER_ABORT,
    HEADER_OK,
    Header,
    NCCLWorkerInitInfo,
    WireParams,
    plan_for,
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
        declared = param_list_digests(param_list_payload(metas))
        digests = BucketDigests.of_plan(plan) if self.wire.verify else None
        with self.channel.on_wire("a broadcast") as group:
            window = SendWindow(self._buffers, transfer)
            packer = Packer(plan, pairs, finite=self.check_finite)
            for k, bucket in enumerate(plan.buckets):
                window.free(k)
                try:  # only the source can fail here: tell the workers, keep the group
                    if self.wire.packed:  # a bucket of one piece goes out as itself
                        out = packer.bytes_of(k, self._buffers)
                    else:
                        out = as_bytes(packer.whole(k).to(self.device))
                    if k == len(plan.buckets) - 1:
                        packer.exhaust()
                except Exception as error:
                    self._abort_at(Header.of(k, HEADER_ABORT, plan, declared), window, transfer)
                    raise AlignedFailure(error) from error
                head = Header.of(k, HEADER_OK, plan, declared).tensor(self.device)
                what = f"the broadcast of bucket {k}"
                sends = [work_future(group.broadcast(t), what) for t in (head, out)]
                keep = [head, out]
                if digests is not None:  # summed while the bytes go out, sent after them
                    sums = digests.of(k, out)
                    sends.append(work_future(group.broadcast(sums), f"the digests of bucket {k}"))
                    keep.append(sums)
                window.sent(k, sends, keep)
                transfer.chunk_moved(bucket.nbytes)
            if not plan.buckets:
                packer.exhaust()
            window.drain()

    def _abort_at(self, head: Header, window: SendWindow, transfer: Transfer) -> None:
        """Tell every worker the round ends at `head`'s bucket (after the sends in flight)."""
        window.drain("the broadcasts before the abort notice")
        group = self.channel.require()
        notice = work_future(group.broadcast(head.tensor(self.device)), "the abort notice")
        transfer.wait(notice, "the abort notice", watching=False)  # they fail on purpose

    def shutdown(self) -> None:
        self.channel.close()
        self._buffers.release()
