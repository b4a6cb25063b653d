"""Trainer side of the `nccl` backend.

Every trainer rank calls `trainer_init` and `send_weights`. Rank 0 hosts the
private group and streams; other ranks only iterate the source, because
materializing a sharded parameter is a collective of the trainer's own groups.

`send_weights` on rank 0: `start_weight_update`; `update_weights` on a side
thread (workers enter their receive loop); stream the buckets; wait for the
workers' answer; `finish_weight_update`. Packing bucket `k + 1` overlaps the
broadcast of bucket `k` (buffers rotate), and every wait watches the
`update_weights` call, so a worker error surfaces at once instead of after a
transport timeout. The side thread is never joined on an error path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from weight_transfer.hooks import SyncTracker, track_sync
from weight_transfer.payload import payload_of
from weight_transfer.source import ParamMeta, checked_iteration
from weight_transfer.transport.dtypes import dtype_name
from weight_transfer.transport.futures import (
    all_settle,
    await_transfer,
    in_background,
    work_future,
)
from weight_transfer.transport.group import StatelessGroup
from weight_transfer.transport.packing import BucketPlan, RotatingBuffers, as_bytes
from weight_transfer.transport.rendezvous import GroupTrainerFields, trainer_rendezvous
from wt_nccl.protocol import (
    HEADER_ABORT,
    HEADER_OK,
    NCCLWorkerInitInfo,
    WireParams,
    header,
    plan_for,
)

__all__ = ["NCCLTrainerInitInfo", "NCCLTrainerEngine"]


@dataclass
class NCCLTrainerInitInfo(WireParams, TrainerInitInfo, GroupTrainerFields):
    """How a trainer configures the `nccl` backend: the group (see
    `GroupTrainerFields`) and the wire parameters, which the sender ships to
    every worker in `trainer_init`."""

    backend: ClassVar[str] = "nccl"


class NCCLTrainerEngine(TrainerWeightTransferEngine[NCCLTrainerInitInfo]):
    init_info_cls = NCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool,
        info: NCCLTrainerInitInfo,
        group: StatelessGroup | None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.wire = info.wire
        self.device = info.resolved_device()
        self.group = group
        self.syncs = 0
        self._buffers = RotatingBuffers(self.wire.packed_num_buffers, self.device)
        self._plan_key: tuple[ParamMeta, ...] | None = None
        self._plan: BucketPlan | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: NCCLTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> NCCLTrainerEngine:
        """Rank 0: rendezvous with every worker (their init runs concurrently)."""
        if source is None:
            raise ValueError("the nccl backend is full-resync: trainer_init needs a WeightSource")
        init_info.validate("NCCLTrainerInitInfo")
        group = None
        if init_info.is_sender:
            payload = payload_of(
                NCCLWorkerInitInfo(
                    **init_info.worker_group_fields(),
                    packed=init_info.packed,
                    packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                    packed_num_buffers=init_info.packed_num_buffers,
                    packed_min_bucket_bytes=init_info.packed_min_bucket_bytes,
                )
            )
            group = trainer_rendezvous(client, payload, init_info)
        return cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            info=init_info,
            group=group,
        )

    def _plan_for(self, metas: list[ParamMeta]) -> BucketPlan:
        key = tuple(metas)
        if self._plan is None or key != self._plan_key:
            self._plan, self._plan_key = plan_for(metas, self.wire), key
        return self._plan

    def send_weights(self, weight_version: str | None = None) -> None:
        """One full round; see the module docstring. Returns with nothing in flight.

        `weight_version` labels the new weights; it is committed by the
        workers' `finish_weight_update`, so it changes together with the weights.
        """
        assert self.source is not None
        metas = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        if self.group is None:
            raise RuntimeError(
                "the nccl group was torn down by an earlier transport failure; "
                "call trainer_init again"
            )
        plan = self._plan_for(metas)
        update_info = {
            "names": [m.name for m in metas],
            "dtype_names": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas],
        }
        self.syncs += 1
        with track_sync(
            "nccl",
            self.syncs,
            num_params=len(metas),
            total_bytes=plan.total_bytes,
            num_chunks=len(plan.buckets),
        ) as tracker:
            self.client.start_weight_update()
            tracker.started()
            rpc = in_background(
                lambda: self.client.update_weights(update_info), name="wt-nccl-update-rpc"
            )
            try:
                self._stream(plan, checked_iteration(metas, self.source), rpc, tracker)
            except _AlignedFailure as failed:
                _wait_quietly(rpc, self.info.timeout_s)  # the workers roll back, then answer
                raise failed.error from None
            except BaseException:
                self._tear_down()
                raise
            await_transfer(
                rpc, watch={}, timeout_s=self.info.timeout_s, what="the workers' update_weights"
            )
            self.client.finish_weight_update(weight_version)
            tracker.weight_version = weight_version

    def _stream(
        self,
        plan: BucketPlan,
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        rpc: Future[None],
        tracker: SyncTracker,
    ) -> None:
        """Broadcast every bucket.

        Raises `_AlignedFailure` when the round failed but every collective
        matched (a source error, after an abort notice went out; or a worker
        that drained the round and then failed). Any other error may leave
        collectives misaligned; the caller tears the group down.
        """
        group = self.group
        assert group is not None
        nb = len(self._buffers)
        in_flight: list[list[Future[None]]] = [[] for _ in range(nb)]
        keep_alive: list[list[torch.Tensor]] = [[] for _ in range(nb)]
        watch = {"the workers' update_weights": rpc}
        timeout = self.info.timeout_s

        def settle(slot: int, what: str) -> None:
            try:
                for fut in in_flight[slot]:
                    await_transfer(fut, watch=watch, timeout_s=timeout, what=what)
            except Exception as error:
                reported = rpc.done() and rpc.exception() is error
                if reported and all_settle(f for futs in in_flight for f in futs):
                    raise _AlignedFailure(error) from error
                raise
            in_flight[slot].clear()
            keep_alive[slot].clear()

        current: torch.Tensor | None = None  # bytes of the parameter being packed
        last = len(plan.buckets) - 1
        for k, bucket in enumerate(plan.buckets):
            slot = k % nb
            settle(slot, f"the broadcast of bucket {k - nb}")
            try:
                if self.wire.packed:
                    out = self._buffers.get(k, bucket.nbytes)
                    for piece in bucket.pieces:
                        if piece.start == 0:
                            current = as_bytes(next(pairs)[1])
                        assert current is not None
                        out[piece.offset : piece.offset + piece.nbytes].copy_(
                            current[piece.start : piece.start + piece.nbytes]
                        )
                else:
                    out = as_bytes(next(pairs)[1].to(self.device))
                if k == last:
                    for _ in pairs:  # the source must end where metadata() does
                        pass
            except Exception as error:
                for s in range(nb):
                    settle(s, "the broadcasts before the abort notice")
                notice = work_future(
                    group.broadcast(header(k, HEADER_ABORT, self.device)), "the abort notice"
                )
                await_transfer(notice, watch={}, timeout_s=timeout, what="the abort notice")
                raise _AlignedFailure(error) from error
            head = header(k, HEADER_OK, self.device)
            what = f"the broadcast of bucket {k}"
            in_flight[slot] = [
                work_future(group.broadcast(head), what),
                work_future(group.broadcast(out), what),
            ]
            keep_alive[slot] = [head, out]
            tracker.chunk_moved(bucket.nbytes)
        if not plan.buckets:
            for _ in pairs:
                pass
        for slot in range(nb):
            settle(slot, "the last broadcasts")

    def _tear_down(self) -> None:
        """Drop a group whose collectives may be misaligned; later rounds refuse to run."""
        if self.group is not None:
            self.group.abort()
            self.group = None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._buffers.release()


class _AlignedFailure(Exception):
    """The round failed, but every collective matched: the group can carry the next round."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _wait_quietly(future: Future[None], timeout_s: float) -> None:
    """Wait for `future` at most `timeout_s`, ignoring its outcome."""
    with contextlib.suppress(Exception):
        await_transfer(future, watch={}, timeout_s=timeout_s, what="the workers' rollback")
