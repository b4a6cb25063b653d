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
once: the engine never waits on the workers' `update_weights` call. If the
group may be out of step after a failure, it is torn down and later sends
raise until `trainer_init` runs again.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from weight_transfer.hooks import SyncTracker, track_sync
from weight_transfer.payload import payload_of
from weight_transfer.transport.futures import (
    PEER_GRACE_S,
    all_settle,
    await_transfer,
    in_background,
    work_future,
)
from weight_transfer.transport.group import StatelessGroup
from weight_transfer.transport.rendezvous import GroupTrainerFields, trainer_rendezvous
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
class _Round:
    """A round opened by `begin()`: its hook context and tracker."""

    context: AbstractContextManager[SyncTracker]
    tracker: SyncTracker

    def finished(self) -> None:
        self.context.__exit__(None, None, None)

    def failed(self, error: BaseException) -> None:
        self.context.__exit__(type(error), error, error.__traceback__)


class SparseNCCLTrainerEngine(TrainerWeightTransferEngine[SparseNCCLTrainerInitInfo]):
    """Sends sparse patches; see the module doc for the round API."""

    init_info_cls = SparseNCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        is_sender: bool,
        info: SparseNCCLTrainerInitInfo,
        group: StatelessGroup | None,
    ) -> None:
        super().__init__(client=client, source=None, is_sender=is_sender)
        self.info = info
        self.group = group
        self.rounds = 0
        self._round: _Round | None = None
        self._no_group_reason = "trainer_init has not connected this engine"

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
        group = None
        if init_info.is_sender:
            worker_info = SparseNCCLInitInfo(**init_info.worker_group_fields())
            group = trainer_rendezvous(client, payload_of(worker_info), init_info)
        return cls(client=client, is_sender=init_info.is_sender, info=init_info, group=group)

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
        patches = list(patches)
        check_patches(patches)
        if self._round is not None:
            raise RuntimeError(
                "send_weights called between begin() and end(); use send_weight_chunk"
            )
        batch = self._prepare(patches)  # before start: a failure here leaves no open round
        self.rounds += 1
        total = sum(p.nbytes for p in patches)
        with track_sync(
            BACKEND, self.rounds, num_params=len(patches), total_bytes=total, num_chunks=1
        ) as tracker:
            self.client.start_weight_update()
            tracker.started()
            tracker.chunk_moved(self._broadcast(batch))
            self._finish(weight_version)
            tracker.weight_version = weight_version

    def begin(self) -> None:
        """Open a round for `send_weight_chunk` calls (`start_weight_update`)."""
        if not self.is_sender:
            return
        if self._round is not None:
            raise RuntimeError("begin() called twice without end()")
        self._require_group()
        self.rounds += 1
        context = track_sync(BACKEND, self.rounds, num_params=0, total_bytes=0, num_chunks=0)
        tracker = context.__enter__()
        try:
            self.client.start_weight_update()
        except BaseException as e:
            context.__exit__(type(e), e, e.__traceback__)
            raise
        tracker.started()
        self._round = _Round(context, tracker)

    def send_weight_chunk(self, patches: Sequence[SparseWeightPatch] | None) -> None:
        """Broadcast `patches` as one batch inside a round the caller opened.

        A patch that fails the checks raises before anything is sent, and the
        round stays open. If the broadcast itself raises inside a `begin()`
        round, that round is over (the workers rolled it back); do not call
        `end()`.
        """
        if not self.is_sender or not patches:
            return
        patches = list(patches)
        check_patches(patches)
        batch = self._prepare(patches)
        current = self._round
        try:
            nbytes = self._broadcast(batch)
        except BaseException as e:
            if current is not None:
                self._round = None
                current.failed(e)
            raise
        if current is not None:
            current.tracker.num_params += len(patches)
            current.tracker.total_bytes += nbytes
            current.tracker.num_chunks += 1
            current.tracker.chunk_moved(nbytes)

    def end(self, weight_version: str | None = None) -> None:
        """Close the round opened by `begin()` (`finish_weight_update(weight_version)`)."""
        if not self.is_sender:
            return
        current, self._round = self._round, None
        if current is None:
            raise RuntimeError(
                "end() without an open round (begin() not called, or a chunk failed)"
            )
        try:
            self._finish(weight_version)
        except BaseException as e:
            current.failed(e)
            raise
        current.tracker.weight_version = weight_version
        current.finished()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
            self._no_group_reason = "the engine was shut down"

    # -- internals -------------------------------------------------------
    def _finish(self, weight_version: str | None) -> None:
        self.client.finish_weight_update(weight_version)

    def _require_group(self) -> StatelessGroup:
        if self.group is None:
            raise RuntimeError(
                f"sparse_nccl: no transfer group ({self._no_group_reason}); run trainer_init"
            )
        return self.group

    def _tear_down(self, reason: str) -> None:
        if self.group is not None:
            self.group.abort()
            self.group = None
        self._no_group_reason = f"it was torn down after {reason}"

    def _prepare(
        self, patches: list[SparseWeightPatch]
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The update payload and the packed wire buffers of checked `patches`."""
        group = self._require_group()
        info = update_info_of(patches)
        return payload_of(info), [pack_group(g, patches, group.device) for g in wire_groups(info)]

    def _broadcast(self, batch: tuple[dict[str, Any], list[torch.Tensor]]) -> int:
        """Send a prepared batch; returns the bytes sent.

        `update_weights` runs on a side thread while the groups are broadcast;
        either failing raises at once. A failed broadcast gives the workers'
        call a moment (`PEER_GRACE_S`) to report why (a worker that refused
        drops its end of the group), and that error is raised instead. The
        group is kept only when every broadcast completed, so both sides stay
        in step.
        """
        group = self._require_group()
        timeout_s = self.info.timeout_s
        payload, buffers = batch
        rpc = in_background(lambda: self.client.update_weights(payload), name="wt-sparse-update")
        watch = {"the workers' update_weights": rpc}
        pending: Future[None] | None = None
        started = 0
        try:
            for i, buffer in enumerate(buffers):
                what = f"broadcast {i + 1}/{len(buffers)} of a sparse batch"
                pending = work_future(group.broadcast(buffer), what)
                started += 1
                await_transfer(pending, watch=watch, timeout_s=timeout_s, what=what)
                pending = None
            await_transfer(rpc, watch={}, timeout_s=timeout_s, what="the workers' update_weights")
        except BaseException as e:
            if not isinstance(e, Exception):  # interrupted: do not wait on anything
                self._tear_down(f"an interrupted batch ({type(e).__name__})")
                raise
            error = e if _failed_with(rpc, 0.0) is e else _failed_with(rpc, PEER_GRACE_S) or e
            if started < len(buffers) or (pending is not None and not all_settle([pending])):
                self._tear_down(f"a failed batch ({type(error).__name__}: {error})")
            if error is e:
                raise
            raise error from e
        return sum(b.numel() for b in buffers)


def _failed_with(future: Future[Any], timeout_s: float) -> BaseException | None:
    """`future`'s error if it fails within `timeout_s`, else None (never waits longer)."""
    try:
        return future.exception(timeout=timeout_s)
    except BaseException:  # still running, or cancelled
        return None
