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
group may be out of step after a failure, it is torn down; the next round
(`send_weights`, `begin`) re-forms it first (`reconnect`), as it does when a
worker refuses a start for want of a group (a restarted worker, one whose
group a failed round tore down). After `shutdown` every send raises.

With `verify=True` every wire group is followed by the digests of its members
(`BucketDigests`), which each worker checks before it applies anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weight_transfer.backend import (
    AlignedFailure,
    ChannelDownError,
    TrainerInitInfo,
    TrainerRound,
    TrainerWeightTransferEngine,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    payload_of,
)
from wt_kits.channel import GroupChannel
from wt_kits.group import GroupTrainerFields, StatelessGroup, trainer_rendezvous
from wt_kits.stream import BucketDigests
from wt_kits.waits import all_settle, work_future
from wt_sparse_nccl.patch import SparseWeightPatch, check_patches
from wt_sparse_nccl.wire import (
    BatchHeader,
    SparseNCCLInitInfo,
    digest_plan,
    pack_group,
    update_info_of,
    wire_groups,
)

__all__ = ["SparseNCCLTrainerInitInfo", "SparseNCCLTrainerEngine"]

BACKEND = "sparse_nccl"

logger = logging.getLogger("weight_transfer")


@dataclass
class SparseNCCLTrainerInitInfo(TrainerInitInfo, GroupTrainerFields):
    """Where rank 0 hosts the group, its size (1 + workers), its wait bound and
    device (see `GroupTrainerFields`); the device type must match the workers'.
    `verify`: every batch carries digests of its bytes, checked by the workers.
    `cast_values`: the workers cast a patch's floating-point values to the dtype
    of the tensor it patches (bf16 deltas into an fp32 checkpoint, as vLLM's
    own sparse backend does); off (default), a dtype mismatch is refused,
    naming the patch, and nothing of its batch is applied.
    """

    backend: ClassVar[str] = BACKEND
    verify: bool = field(default=False, kw_only=True)
    cast_values: bool = field(default=False, kw_only=True)


@dataclass
class _Batch:
    """One checked, packed batch: its update info, its broadcasts in wire order
    (header, then each wire group's bytes and, with verify, digests) and the
    bytes of its wire groups (what the hooks report)."""

    payload: dict[str, Any]
    broadcasts: list[torch.Tensor]
    num_patches: int
    nbytes: int


class SparseNCCLTrainerEngine(TrainerWeightTransferEngine[SparseNCCLTrainerInitInfo]):
    """Sends sparse patches; see the module doc for the round API."""

    init_info_cls = SparseNCCLTrainerInitInfo
    sends_adapters = False  # a patch applies to the model's weights

    def __init__(
        self,
        *,
        info: SparseNCCLTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> None:
        if source is not None:
            raise ValueError(
                "sparse_nccl is a delta backend and takes no WeightSource; "
                "pass each round's patches to send_weights(patches)"
            )
        super().__init__(info=info, client=client)
        self.info: SparseNCCLTrainerInitInfo = info
        self.channel: GroupChannel[StatelessGroup] = GroupChannel(
            BACKEND, remedy="the next round re-forms it (send_weights or begin)"
        )
        self._round: TrainerRound | None = None
        self._shut_down = False

    def connect(self) -> None:
        """Host the group's rendezvous while every worker joins (their init runs concurrently)."""
        fields = self.info.worker_group_fields(self.trainer_id)
        worker_info = SparseNCCLInitInfo(
            **fields, verify=self.info.verify, cast_values=self.info.cast_values
        )
        self.channel.connect(trainer_rendezvous(self.client, payload_of(worker_info), self.info))

    def reconnect(self) -> None:
        """Re-form the group with every worker (at a round boundary), on the same port.

        A restarted worker rejoins with the weights it loaded itself: patches
        are deltas, so the rounds it missed are not replayed.
        """
        if self._shut_down:
            self.channel.require()  # raises: it was shut down
        self.channel.close("it is being re-formed")
        self.connect()

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
        self._ready()
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
        self._ready()
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
            current = TrainerRound.unreported(self.client, BACKEND, self.timeout_s)
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
        self._shut_down = True
        self.channel.close()

    # -- internals -------------------------------------------------------
    def _ready(self) -> None:
        """Before a round: re-form a group that a failed round tore down (not one shut down)."""
        try:
            self.channel.require()
        except ChannelDownError as down:
            if self._shut_down:
                raise
            logger.warning("%s: re-forming the group before the round (%s)", BACKEND, down)
            self.reconnect()

    def _prepare(self, patches: list[SparseWeightPatch]) -> _Batch:
        """Check and pack `patches` with their header (and digests); raises
        `ValueError` naming a bad patch."""
        check_patches(patches)
        device = self.channel.require().device
        info = update_info_of(patches)
        groups = wire_groups(info, aligned=self.info.verify)
        data = [pack_group(g, patches, device) for g in groups]
        broadcasts = [BatchHeader.of(info, groups).tensor(device)]
        digests = BucketDigests(digest_plan(info, groups)) if self.info.verify else None
        for k, buffer in enumerate(data):
            broadcasts.append(buffer)
            if digests is not None:
                broadcasts.append(digests.of(k, buffer))
        payload = {**payload_of(info), "trainer_id": self.trainer_id}
        return _Batch(payload, broadcasts, len(patches), sum(b.numel() for b in data))

    def _transmit(self, batch: _Batch, transfer: Transfer) -> None:
        """Broadcast the batch in wire order.

        The group is kept after a failure only when every broadcast completed,
        so both sides stay in step (a worker that refused the batch after
        receiving it whole: gloo completes a send only once it was received).
        """
        with self.channel.on_wire("a sparse batch") as group:
            pending = None
            started = 0
            total = len(batch.broadcasts)
            try:
                for i, tensor in enumerate(batch.broadcasts):
                    what = f"broadcast {i + 1}/{total} of a sparse batch"
                    pending = work_future(group.broadcast(tensor), what)
                    started += 1
                    transfer.wait(pending, what)
                    pending = None
                transfer.chunk_moved(batch.nbytes)
            except Exception as error:
                if started == total and (pending is None or all_settle([pending])):
                    raise AlignedFailure(error) from error
                raise
