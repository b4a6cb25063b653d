"""Worker side of the `nccl` backend.

`receive_weights` walks the same bucket plan as the trainer. Receiving bucket
`k + 1` overlaps loading bucket `k` (loads run in order on one loader thread),
because on CPU the load into a live model costs more than the wire.

Buffer reuse: bucket `k` lands in rotating buffer `k % n`. Before receiving
bucket `j`, the worker waits for the load of bucket `j - min(n, 2)`, so at
least that much of the pipeline has drained. A tensor is handed to the loader
as a view into the buffer only if its layer completes within the buckets that
wait covers (a loader such as vLLM's layerwise reload keeps a layer's tensors
until the layer is complete); otherwise it is copied out first (`Unpacker`).

Failure: if loading fails, the worker keeps receiving (and discarding) the
rest of the round so the group stays aligned, then raises; if the trainer
sends an abort notice, the worker stops at once and raises. Either way the
base class aborts the round and the model keeps its previous weights. A
transport failure tears the group down; the trainer must `trainer_init` again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch

from weight_transfer.base import WeightTransferEngine
from weight_transfer.loading import WeightLoader
from weight_transfer.transport.group import StatelessGroup
from weight_transfer.transport.packing import RotatingBuffers, Unpacker
from weight_transfer.transport.rendezvous import join_group
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

    group: StatelessGroup | None = None
    wire: WireParams | None = None
    _buffers: RotatingBuffers | None = None
    _loader: WeightLoader | None = None

    def init_transfer_engine(self, init_info: NCCLWorkerInitInfo) -> None:
        """Record the trainer's wire parameters and join its group (replacing an old one).

        The group (and the receive buffers) live where the trainer's transport
        puts them: on this worker's GPU for NCCL, on CPU for gloo (see
        `join_group`); the loader copies into the model.
        """
        if self.group is not None:
            self.group.abort()
            self.group = None
        self.wire = init_info.wire
        self.group = join_group(init_info, self.position, self.device)
        buffers = self._buffers
        if buffers is None or (len(buffers), buffers.device) != (
            self.wire.packed_num_buffers,
            self.group.device,
        ):
            self._buffers = RotatingBuffers(self.wire.packed_num_buffers, self.group.device)

    def start_weight_update(self) -> None:
        self._loader = self.new_loader()
        self._loader.begin()

    def receive_weights(self, update_info: NCCLUpdateInfo) -> None:
        if self.group is None or self.wire is None or self._buffers is None:
            raise RuntimeError(
                "update_weights before init_weight_transfer_engine (or after a transport "
                "failure tore the group down; the trainer must run trainer_init again)"
            )
        if self._loader is None:
            raise RuntimeError("update_weights before start_weight_update")
        try:
            self._receive(update_info, self.group, self.wire, self._buffers, self._loader)
        except (TrainerAbortedError, _LoadFailed):
            raise
        except BaseException:
            self.group.abort()
            self.group = None
            raise

    def _receive(
        self,
        update_info: NCCLUpdateInfo,
        group: StatelessGroup,
        wire: WireParams,
        buffers: RotatingBuffers,
        loader: WeightLoader,
    ) -> None:
        plan = plan_for(update_info.metas, wire)
        unpacker = Unpacker(plan, group.device)
        nb = len(buffers)
        # A receive into bucket j's buffer waits for the load of bucket j - lag;
        # views may outlive their bucket by `horizon` buckets.
        lag = min(nb, 2)
        horizon = nb - lag
        loads: list[Future[None]] = []
        failure: BaseException | None = None
        head = torch.empty(2, dtype=torch.int64, device=group.device)
        wait = timedelta(seconds=group.timeout_s)
        pool = ThreadPoolExecutor(1, thread_name_prefix="wt-nccl-load")
        try:
            for k, bucket in enumerate(plan.buckets):
                if failure is None and k >= lag:
                    failure = _error_of(loads[k - lag], group.timeout_s)
                    if failure is not None:
                        for fut in loads:  # queued loads would read buffers the drain reuses
                            fut.cancel()
                group.broadcast(head).wait(wait)
                seq, status = (int(v) for v in head.tolist())
                if seq != k or status != HEADER_OK:
                    if seq != k:
                        raise RuntimeError(f"wire out of step: expected bucket {k}, got {seq}")
                    raise TrainerAbortedError(
                        f"the trainer aborted the update at bucket {k} of {len(plan.buckets)}; "
                        "see the trainer's error"
                    )
                if wire.packed:
                    data = buffers.get(k, bucket.nbytes)
                else:
                    data = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
                group.broadcast(data).wait(wait)
                if failure is not None:
                    continue  # drain: keep the group aligned, load nothing more
                tensors = unpacker.unpack(k, data, view_horizon=horizon)
                if tensors:
                    loads.append(pool.submit(loader.load, tensors))
                else:
                    loads.append(_done())
            for fut in loads:
                if fut.cancelled():
                    continue
                failure = failure or _error_of(fut, group.timeout_s)
        finally:
            # Queued loads never start; a running one is waited for (bounded), so
            # the round's rollback cannot race with it.
            for fut in loads:
                fut.cancel()
            for fut in loads:
                if not fut.cancelled():
                    _error_of(fut, group.timeout_s)
            pool.shutdown(wait=False)
        if failure is not None:
            raise _LoadFailed(f"loading the received weights failed: {failure}") from failure

    def finish_weight_update(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.commit()

    def abort_weight_update(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.abort()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self._buffers is not None:
            self._buffers.release()


class _LoadFailed(RuntimeError):
    """Loading failed after the round was drained; the group is still aligned."""


def _error_of(fut: Future[None], timeout_s: float) -> BaseException | None:
    """The load's error, if any; a load that outlives `timeout_s` is an error too."""
    try:
        return fut.exception(timeout=timeout_s)
    except TimeoutError:
        return TimeoutError(f"a load into the model took longer than {timeout_s:g}s")


def _done() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut
