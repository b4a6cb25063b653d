"""The two streaming loops every bucketed backend runs: send window and load pipeline.

Trainer: `SendWindow` keeps up to `len(buffers)` buckets in flight over
rotating buffers. `buffer(k, nbytes)` returns bucket `k`'s staging buffer
after the sends that last used it (bucket `k - n`) have completed, so packing
bucket `k + 1` overlaps sending bucket `k`. Every wait watches the round's
`Transfer`: a worker that fails surfaces its error at once. When that happens
and every send in flight still completes, the workers drained the round in
step, so the failure is raised as `AlignedFailure` (the group is kept).

Worker: `LoadPipeline` loads received buckets on one loader thread while the
next is received. The buffer-reuse rule: before receiving bucket `j` into
buffer `j % n`, wait for the load of bucket `j - lag` (`lag = min(n, 2)`), so
a tensor may be handed to the loader as a view into its buffer only when its
layer completes within `horizon = n - lag` buckets (`Unpacker`'s
`view_horizon`); later ones are copied out first. A load that fails switches
the pipeline to draining: queued loads are cancelled, the caller keeps
receiving (the group stays aligned) and loads nothing more, and `finish()`
raises `LoadFailed`. `close()` (always, in a `finally`) cancels queued loads
and waits for a running one, bounded, so a rollback never races a load.

Verified bytes: `received(k, buf, unpacker, digests)` is the one call a
receive loop makes per bucket. It runs the test-only receive hooks
(`digests.bucket_landed`), unpacks and queues the load; with the trainer's
`digests` the queued task first checks the bucket's bytes in `buf`
(`BucketDigests.check`) and loads nothing when they differ. `buf` is intact
then, because the reuse rule waits for that very task before `buf` is
received into again. Once a task fails, later tasks load nothing (a split
tensor completed by a later bucket would carry the corrupt bytes), so
nothing of a corrupt bucket reaches the model; `finish()` raises
`LoadFailed` with the mismatch's message (bucket, parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from weight_transfer.rounds import AlignedFailure, Transfer
from weight_transfer.runtime.phases import timed
from weight_transfer.runtime.waiting import all_settle
from wt_kits.stream.digests import BucketDigests, DigestMismatch, bucket_landed
from wt_kits.stream.packing import RotatingBuffers, Unpacker

__all__ = ["SendWindow", "LoadPipeline", "LoadFailed"]

Load = Callable[[list[tuple[str, torch.Tensor]]], None]


class SendWindow:
    """Rotating staging buffers with the sends in flight on each; see the module doc."""

    def __init__(self, buffers: RotatingBuffers, transfer: Transfer) -> None:
        self.buffers = buffers
        self.transfer = transfer
        n = len(buffers)
        self._in_flight: list[list[Future[None]]] = [[] for _ in range(n)]
        self._keep_alive: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def free(self, k: int) -> None:
        """Wait until bucket `k`'s slot has no sends in flight."""
        self.settle(k % len(self.buffers), f"the sends of bucket {k - len(self.buffers)}")

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Bucket `k`'s staging buffer (`nbytes` long), once its slot is free."""
        self.free(k)
        return self.buffers.get(k, nbytes)

    def sent(self, k: int, sends: Iterable[Future[None]], keep: Iterable[torch.Tensor]) -> None:
        """Record bucket `k`'s sends in flight and the tensors they read."""
        slot = k % len(self.buffers)
        self._in_flight[slot] = list(sends)
        self._keep_alive[slot] = list(keep)

    def settle(self, slot: int, what: str) -> None:
        try:
            with timed("wire"):
                for future in self._in_flight[slot]:
                    self.transfer.wait(future, what)
        except Exception as error:
            if self.transfer.worker_error() is error and all_settle(
                f for sends in self._in_flight for f in sends
            ):
                raise AlignedFailure(error) from error
            raise
        self._in_flight[slot].clear()
        self._keep_alive[slot].clear()

    def drain(self, what: str = "the last sends") -> None:
        """Wait for every send in flight."""
        for slot in range(len(self.buffers)):
            self.settle(slot, what)


class LoadFailed(RuntimeError):
    """Loading failed; the round was drained, so the group is still aligned."""


class LoadPipeline:
    """Ordered loads on one thread beside the receive loop; see the module doc."""

    def __init__(self, load: Load, num_buffers: int, timeout_s: float, *, name: str) -> None:
        self.load = load
        self.timeout_s = timeout_s
        self.lag = min(num_buffers, 2)
        self.horizon = num_buffers - self.lag
        self.failure: BaseException | None = None
        self._loads: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._broken = False  # a task failed: later tasks load nothing

    @property
    def draining(self) -> bool:
        return self.failure is not None

    def before_receive(self, k: int) -> None:
        """Apply the buffer-reuse rule before bucket `k` is received."""
        if self.failure is None and k >= self.lag:
            self.failure = self._error_of(self._loads[k - self.lag])
            if self.failure is not None:
                for future in self._loads:  # queued loads would read buffers the drain reuses
                    future.cancel()

    def submit(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Queue the load of one received bucket (nothing while draining)."""
        if self.failure is not None or not tensors:
            done: Future[None] = Future()
            done.set_result(None)
            self._loads.append(done)
            return
        self._loads.append(self._pool.submit(self._task, tensors, None))

    def received(
        self,
        k: int,
        buf: torch.Tensor,
        unpacker: Unpacker,
        digests: torch.Tensor | None = None,
    ) -> None:
        """Bucket `k` landed in `buf`: hooks, then (unless draining) unpack and queue
        its load, checked first against the trainer's `digests` when given.

        `digests` must not be reused by the caller (the check runs later, on
        the loader thread).
        """
        bucket_landed(k, buf)
        if self.failure is not None:
            self.submit([])
            return
        tensors = unpacker.unpack(k, buf, view_horizon=self.horizon)
        check: Callable[[], None] | None = None
        if digests is not None:
            verifier = BucketDigests.of_plan(unpacker.plan)

            def check() -> None:
                verifier.check(k, buf, digests)

        if not tensors and check is None:
            self.submit([])
            return
        self._loads.append(self._pool.submit(self._task, tensors, check))

    def _task(
        self, tensors: list[tuple[str, torch.Tensor]], check: Callable[[], None] | None
    ) -> None:
        """One queued bucket on the loader thread: its check, then its load."""
        if self._broken:
            return
        try:
            if check is not None:
                check()
            if tensors:
                self.load(tensors)
        except BaseException:
            self._broken = True
            raise

    def finish(self) -> None:
        """Wait for every load; raise `LoadFailed` if one failed."""
        for future in self._loads:
            if self.failure is not None:
                break
            if not future.cancelled():
                self.failure = self._error_of(future)
        if isinstance(self.failure, DigestMismatch):
            raise LoadFailed(str(self.failure)) from self.failure
        if self.failure is not None:
            raise LoadFailed(
                f"loading the received weights failed: {self.failure}"
            ) from self.failure

    def close(self) -> None:
        for future in self._loads:
            future.cancel()
        for future in self._loads:
            if not future.cancelled():
                self._error_of(future)
        self._pool.shutdown(wait=False)

    def _error_of(self, future: Future[None]) -> BaseException | None:
        """The load's error, if any; one that outlives `timeout_s` is an error too."""
        try:
            return future.exception(timeout=self.timeout_s)
        except TimeoutError:
            return TimeoutError(f"a load into the model took longer than {self.timeout_s:g}s")
