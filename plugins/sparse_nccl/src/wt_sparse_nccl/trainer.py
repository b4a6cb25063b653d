"""Trainer side of `sparse_nccl`: broadcast sparse patches from trainer rank 0.

A delta backend: there is no `WeightSource`; each round's patches are passed
to the engine. Only rank 0 joins the transfer group and calls the client;
every method is a no-op on other ranks.

- `send_weights(patches)`: one whole round (start, one batch, finish).
- `begin()`, `send_weight_chunk(patches)` (any number), `end()`: a round
  built from several batches. A caller may instead drive the client itself
  (`client.start_weight_update()`, chunks, `client.finish_weight_update()`);
  such chunks are not reported to the lifecycle hooks.

An empty or `None` patch list sends nothing and makes no call at all. Patches
are checked (`check_patches`) before anything is sent; a bad one raises
`ValueError` naming it. On a transmission error the real error is raised at
once (a worker's own refusal in preference to the broken send it caused); the
engine never waits on the workers' `update_weights` call otherwise. If the
group may be out of step after a failure, it is torn down and later sends
raise until `trainer_init` runs again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weight_transfer.backend import (
    AlignedFailure,
    GroupChannel,
    GroupTrainerFields,
    StatelessGroup,
    SyncTracker,
    TrainerInitInfo,
    TrainerRound,
    TrainerWeightTransferEngine,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    all_settle,
    payload_of,
    trainer_rendezvous,
    work_future,
)
from wt_sparse_nccl.patch import SparseWeightPatch, check_patches
from wt_sparse_nccl.wire import SparseNCCLInitInfo, pack_group, update_info_of, wire_groups

__all__ = ["SparseNCCLTrainerInitInfo", "SparseNCCLTrainerEngine"]

BACKEND = "sparse_nccl"


@dataclass
class SparseNCCLTrainerInitInfo(TrainerInitInfo, GroupTrainerFields):
    """Where rank 0 hosts the group, its size (1 + workers), its wait bound and
    device (see `GroupTrainerFields`); the device type must match the workers'."""

    backend: ClassVar[str] = BACKEND


@dataclass
class _Batch:
    """One checked, packed batch: its update info and its broadcasts in wire order."""

    payload: dict[str, Any]
    buffers: list[torch.Tensor]
    num_patches: int

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


class SparseNCCLTrainerEngine(TrainerWeightTransferEngine[SparseNCCLTrainerInitInfo]):
    """Sends sparse patches; see the module doc for the round API."""

    init_info_cls = SparseNCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        is_sender: bool,
        info: SparseNCCLTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=None, is_sender=is_sender, timeout_s=info.timeout_s)
        self.info = info
        self.channel: GroupChannel[StatelessGroup] = GroupChannel(
            BACKEND, remedy="run trainer_init again"
        )
        self._round: TrainerRound | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: SparseNCCLTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> SparseNCCLTrainerEngine:
        """Rank 0: host the group while the workers join it (their init RPC runs on a
        side thread; a failure of either raises at once). Other ranks: nothing."""
        if source is not None:
            raise ValueError(
                "sparse_nccl is a delta backend and takes no WeightSource; "
                "pass each round's patches to send_weights(patches)"
            )
        engine = cls(client=client, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            worker_info = SparseNCCLInitInfo(**init_info.worker_group_fields(engine.trainer_id))
            engine.channel.connect(
                trainer_rendezvous(engine.client, payload_of(worker_info), init_info)
            )
        return engine

    # -- rounds ----------------------------------------------------------
    def send_weights(
        self,
        patches: Sequence[SparseWeightPatch] | None = None,
        *,
        weight_version: str | None = None,
    ) -> None:
        """One round: start, broadcast `patches` as one batch, finish (with `weight_version`)."""
        if not self.is_sender or not patches:
            return
        if self._round is not None:
            raise RuntimeError(
                "send_weights called between begin() and end(); use send_weight_chunk"
            )
        batch = self._prepare(list(patches))  # before start: a failure leaves no open round
        round_ = self.open_round(
            num_params=batch.num_patches, total_bytes=batch.nbytes, num_chunks=1
        )
        round_.update(batch.payload, lambda transfer: self._transmit(batch, transfer))
        round_.finish(weight_version)

    def begin(self) -> None:
        """Open a round for `send_weight_chunk` calls (`start_weight_update`)."""
        if not self.is_sender:
            return
        if self._round is not None:
            raise RuntimeError("begin() called twice without end()")
        self.channel.require()
        self._round = self.open_round(num_params=0, total_bytes=0, num_chunks=0)

    def send_weight_chunk(self, patches: Sequence[SparseWeightPatch] | None = None) -> None:
        """Broadcast `patches` as one batch inside a round; no patches, no call.

        A patch that fails the checks raises before anything is sent, and the
        round stays open. If the broadcast itself raises inside a `begin()`
        round, that round is over (the workers rolled it back); do not call
        `end()`. Without `begin()` the caller drives the round through the
        client itself, and the chunk is not reported to the hooks.
        """
        if not self.is_sender or not patches:
            return
        batch = self._prepare(list(patches))
        current = self._round
        if current is None:
            untracked = SyncTracker(BACKEND, 0, 0, 0, 0, enabled=False)
            current = TrainerRound(self.client, untracked, self.timeout_s)
        else:
            current.tracker.num_params += batch.num_patches
            current.tracker.total_bytes += batch.nbytes
            current.tracker.num_chunks += 1
        try:
            current.update(batch.payload, lambda transfer: self._transmit(batch, transfer))
        finally:
            if current.closed:
                self._round = None

    def end(self, weight_version: str | None = None) -> None:
        """Close the round opened by `begin()` (`finish_weight_update(weight_version)`)."""
        if not self.is_sender:
            return
        current, self._round = self._round, None
        if current is None:
            raise RuntimeError(
                "end() without an open round (begin() not called, or a chunk failed)"
            )
        current.finish(weight_version)

    def shutdown(self) -> None:
        self.channel.close()

    # -- internals -------------------------------------------------------
    def _prepare(self, patches: list[SparseWeightPatch]) -> _Batch:
        """Check and pack `patches`; raises `ValueError` naming a bad patch."""
        check_patches(patches)
        group = self.channel.require()
        info = update_info_of(patches)
        buffers = [pack_group(g, patches, group.device) for g in wire_groups(info)]
        payload = {**payload_of(info), "trainer_id": self.trainer_id}
        return _Batch(payload, buffers, len(patches))

    def _transmit(self, batch: _Batch, transfer: Transfer) -> None:
        """Broadcast the batch's buffers in order.

        The group is kept after a failure only when every broadcast completed,
        so both sides stay in step (a worker that refused the batch after
        receiving it whole).
        """
        with self.channel.on_wire("a sparse batch") as group:
            pending = None
            started = 0
            try:
                for i, buffer in enumerate(batch.buffers):
                    what = f"broadcast {i + 1}/{len(batch.buffers)} of a sparse batch"
                    pending = work_future(group.broadcast(buffer), what)
                    started += 1
                    transfer.wait(pending, what)
                    pending = None
                transfer.chunk_moved(batch.nbytes)
            except Exception as error:
                if started == len(batch.buffers) and (pending is None or all_settle([pending])):
                    raise AlignedFailure(error) from error
                raise
