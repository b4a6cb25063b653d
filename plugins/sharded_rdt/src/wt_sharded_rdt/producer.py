"""The producer: one per trainer rank, serving slices of what that rank holds.

A plain class; a transport hosts it (`wt_sharded_rdt.transport`: in the
trainer's process for the loopback transport, as a Ray actor for NIXL). Per
sync, driven by its trainer rank:

    begin_sync(sync_id, live)     consumers that must free each group
    publish(groups)               never blocks; the groups' names become servable
                                  (one call per span of groups, `pull_span`)
    wait_freed(within_s)          groups every live consumer has freed
    end_sync()                    waits until every published group is freed

and by the consumers:

    serve(sync_id, consumer, seq, keys, expect)   replay each key's chain on the
                                  published tensor, lay the slices out
                                  (`blob_layout`) in the consumer's serve
                                  slot `seq % K` (with `verify`, their digest
                                  rows after them), return that blob
    free(sync_id, consumer, groups)
    heartbeat(sync_id, consumer)
    skip(sync_id, consumer)       the consumer's update leaves it out of the sync
    consumer_failed(sync_id, consumer, message)   the consumer's update failed

Invariants:
- A group's tensors are dropped only when every live consumer has freed it,
  and a consumer frees a group only after its pulls of it have landed, so a
  serve never reads released memory.
- Slot `seq % K` of a consumer is reused by pull `seq + K`, which that
  consumer issues only after pull `seq` landed (at most K in flight, FIFO).
  `seq` is the consumer's issue order, not the producer's arrival order.
- Signals carry the sync id: a late free never credits the next sync; a pull
  for an older sync is refused, one for the next waits for it to begin.
- Every wait is bounded. A sync with no progress (publish, serve or free;
  a heartbeat is not progress) for `stall_timeout_s` fails every waiter,
  naming the groups and the consumers they wait for; a consumer seen this sync that then stays
  silent for `peer_timeout_s` while a group waits for its free fails it
  naming that consumer. `set_error` (the trainer rank failed) and
  `consumer_failed` wake and fail every waiter too; they name their sync, so
  an error that arrives before the sync begins here still fails it, and a
  late one never fails the next.
- The live set is the trainer's (`begin_sync`), never a consumer's: a
  consumer that skips a sync it is live in, or pulls in one it is not live
  in, fails that sync at once (its update disagrees with the trainer's).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backend import dtype_name
from wt_kits.slices import FetchKey, apply_chain, describe_chain
from wt_sharded_rdt.protocol import blob_digests, blob_layout, digests_view

__all__ = ["Producer", "ProducerError", "POLL_S"]

logger = logging.getLogger("wt_sharded_rdt")

POLL_S = 0.5  # how often a blocked wait re-checks the watchdog


class ProducerError(RuntimeError):
    """The sync failed at a producer (stall, silent consumer, misroute, trainer error)."""


class Producer:
    def __init__(
        self,
        *,
        rank: int,
        served_names: Sequence[str],
        digest: str,
        held: Sequence[bool],
        num_buffers: int,
        stall_timeout_s: float,
        peer_timeout_s: float,
        param_digests: Sequence[int] = (),
        verify: bool = False,
        shard_layouts: dict[str, list[list[int]]] | None = None,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.rank = rank
        self.served = frozenset(served_names)
        self.digest = digest
        self.param_digests = list(param_digests)
        self.verify = verify
        self.shard_layouts = dict(shard_layouts or {})
        self.held = list(held)
        self.num_buffers = num_buffers
        self.stall_timeout_s = stall_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._cond = threading.Condition()
        self._sync = 0
        self._live: frozenset[int] = frozenset()
        self._published: dict[int, dict[str, torch.Tensor]] = {}
        self._freed_by: dict[int, set[int]] = {}
        self._early: dict[int, list[tuple[int, int]]] = {}  # sync -> (consumer, group)
        self._early_skips: dict[int, set[int]] = {}  # sync -> consumers that skip it
        self._early_error: tuple[int, str] | None = None  # (sync, why) before it began
        self._released: list[int] = []
        self._cache: dict[str, torch.Tensor] = {}
        self._rings: dict[int, list[torch.Tensor | None]] = {}
        self._seen: dict[int, float] = {}
        self._progress = time.monotonic()
        self._error: str | None = None
        self.served_bytes = 0  # slice bytes served in the current (or last) sync

    # -- description ------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What a handshake must agree with: this rank, its metadata (one digest in
        all and one per field of `PARAM_LIST_FIELDS`), its held mask, `verify`, the
        layouts of the local shards it serves (empty: it serves full tensors)."""
        return {
            "rank": self.rank,
            "digest": self.digest,
            "param_digests": self.param_digests,
            "held": self.held,
            "verify": self.verify,
            "shard_layouts": self.shard_layouts,
            "served_bytes": self.served_bytes,
            "pid": os.getpid(),
        }

    def ping(self) -> int:
        return os.getpid()

    # -- trainer side -----------------------------------------------------
    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None:
        with self._cond:
            self._sync = sync_id
            self._live = frozenset(live)
            self._published, self._freed_by, self._released = {}, {}, []
            self._cache, self._seen, self._error = {}, {}, None
            self._progress = time.monotonic()
            self.served_bytes = 0
            for consumer, group in self._early.pop(sync_id, []):
                self._freed_by.setdefault(group, set()).add(consumer)
            self._early = {s: v for s, v in self._early.items() if s > sync_id}
            early_error, self._early_error = self._early_error, None
            if early_error is not None and early_error[0] == sync_id:
                self._error = early_error[1]
            for consumer in sorted(self._early_skips.pop(sync_id, ())):
                self._refuse_skip(consumer)
            self._early_skips = {s: v for s, v in self._early_skips.items() if s > sync_id}
            self._cond.notify_all()

    def publish(self, groups: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Make `groups` (group index -> its tensors by name) servable."""
        with self._cond:
            self._check_error()
            for group, tensors in groups.items():
                self._published[group] = dict(tensors)
                self._cache.update(tensors)
            self._touch()
            for group in groups:
                self._release_if_done(group)
            self._cond.notify_all()

    def wait_freed(self, within_s: float) -> list[int]:
        """Groups released since the last call; `[]` if none within `within_s`."""
        deadline = time.monotonic() + within_s
        with self._cond:
            while not self._released:
                self._check_locked()
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(min(left, POLL_S))
            released, self._released = self._released, []
            return released

    def end_sync(self) -> None:
        with self._cond:
            while self._published:
                self._check_locked()
                self._cond.wait(POLL_S)
            self._cache = {}

    def consumer_failed(self, sync_id: int, consumer: int, message: str) -> None:
        """`consumer` failed (or refused) what it took for sync `sync_id`.

        Like `set_error(message, sync_id)`, except that a consumer which still
        owes this running sync a free fails it whatever `sync_id` it names: its
        update named a sync the trainer is not running, so this one cannot end.
        """
        with self._cond:
            if sync_id > self._sync and self._owes_free(consumer):
                sync_id = self._sync
        self.set_error(message, sync_id)

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        """Fail the sync `sync_id` (default: the current one), waking every waiter.

        An error for a sync that has not begun here is kept for the next
        `begin_sync`, which takes it if it begins that very sync (a consumer can
        refuse its update before a rank begins the sync); one for an older sync
        is dropped (it must not fail the next).
        """
        with self._cond:
            if sync_id is not None and sync_id > self._sync:
                self._early_error = (sync_id, message)
                return
            if sync_id is not None and sync_id < self._sync:
                return
            if self._error is None:
                self._error = message
            self._published, self._cache = {}, {}
            self._cond.notify_all()

    # -- consumer side ----------------------------------------------------
    def reserve(self, consumer: int, nbytes: int) -> None:
        """Allocate `consumer`'s ring of K serve slots of `nbytes` (idempotent, grows)."""
        with self._cond:
            ring = self._rings.setdefault(consumer, [None] * self.num_buffers)
            for k, slot in enumerate(ring):
                if slot is None or slot.numel() < nbytes:
                    ring[k] = self._allocate(max(nbytes, 1))

    def heartbeat(self, sync_id: int, consumer: int) -> None:
        with self._cond:
            if sync_id == self._sync:  # liveness only: a heartbeat is not progress
                self._seen[consumer] = time.monotonic()

    def skip(self, sync_id: int, consumer: int) -> None:
        """`consumer`'s update for `sync_id` leaves it out of the live set: if this
        sync's live set (the trainer's) has it, the sync fails now, naming it, rather
        than wait a stall timeout for frees that will not come."""
        with self._cond:
            if sync_id > self._sync:
                self._early_skips.setdefault(sync_id, set()).add(consumer)
            elif sync_id == self._sync:
                self._refuse_skip(consumer)
                self._cond.notify_all()

    def free(self, sync_id: int, consumer: int, groups: Sequence[int]) -> bool:
        """Count `consumer`'s free of each of `groups` (one call for the groups a landed
        pull completes); False if it belongs to an older sync."""
        with self._cond:
            if sync_id > self._sync:
                self._early.setdefault(sync_id, []).extend((consumer, g) for g in groups)
                return True
            if sync_id < self._sync:
                return False
            self._seen[consumer] = time.monotonic()
            self._touch()
            for group in groups:
                self._freed_by.setdefault(group, set()).add(consumer)
                self._release_if_done(group)
            self._cond.notify_all()
            return True

    def serve(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: Sequence[FetchKey],
        expect: Sequence[tuple[str, int]],
    ) -> torch.Tensor:
        """The blob of `keys`' slices; see the module docstring."""
        if seq < 0:
            raise ValueError(
                f"consumer {consumer}: a pull needs its issue number 'seq' (got {seq})"
            )
        if len(expect) != len(keys):
            raise ValueError(
                f"consumer {consumer}: {len(keys)} keys but {len(expect)} expectations"
            )
        for name, _ in keys:
            if name not in self.served:
                raise ProducerError(
                    f"producer rank {self.rank} does not hold {name!r}: consumer {consumer} "
                    "misrouted its pull"
                )
        tensors = self._await_names(sync_id, consumer, [name for name, _ in keys])
        slices = []
        for (name, chain), tensor, (dtype, numel) in zip(keys, tensors, expect, strict=True):
            try:
                piece = apply_chain(tensor, chain)
            except Exception as error:
                raise ProducerError(f"{name!r} ({describe_chain(chain)}): {error}") from error
            if dtype_name(piece.dtype) != dtype or piece.numel() != numel:
                raise ProducerError(
                    f"{name!r} ({describe_chain(chain)}): the slice is {dtype_name(piece.dtype)} "
                    f"x {piece.numel()}, consumer {consumer} expects {dtype} x {numel}"
                )
            slices.append(piece)
        sizes = [p.numel() * p.element_size() for p in slices]
        layout = blob_layout(sizes, self.verify)
        nbytes = layout.nbytes
        with self._cond:
            ring = self._rings.setdefault(consumer, [None] * self.num_buffers)
            slot = ring[seq % self.num_buffers]
            if slot is None or slot.numel() < nbytes:
                logger.warning(
                    "producer rank %d: consumer %d's serve slot grows to %d bytes "
                    "(reserve it at init)", self.rank, consumer, nbytes,
                )  # fmt: skip
                slot = ring[seq % self.num_buffers] = self._allocate(max(nbytes, 1))
        targets, sources = [], []
        for piece, offset, size in zip(slices, layout.offsets, sizes, strict=True):
            if size:
                targets.append(slot[offset : offset + size].view(piece.dtype).view(piece.shape))
                sources.append(piece)
        if targets:  # the pull's slices into its blob, one batched copy
            torch._foreach_copy_(targets, sources)
        if self.verify:  # digests of the bytes as they leave, in the blob's own tail
            digests_view(slot, layout).copy_(blob_digests(tuple(sizes)).of(0, slot))
        with self._cond:
            self._seen[consumer] = time.monotonic()
            self.served_bytes += sum(sizes)
            self._touch()
        return slot[:nbytes]

    # -- internals ----------------------------------------------------------
    def _await_names(self, sync_id: int, consumer: int, names: list[str]) -> list[torch.Tensor]:
        arrived = time.monotonic()
        with self._cond:
            while True:
                if sync_id < self._sync:
                    raise ProducerError(
                        f"producer rank {self.rank} is at sync {self._sync}; consumer {consumer} "
                        f"pulled for sync {sync_id}"
                    )
                if sync_id == self._sync:
                    if self._live and consumer not in self._live:
                        raise ProducerError(
                            f"consumer {consumer} pulled in sync {sync_id}, whose live set "
                            "(the trainer's) leaves it out: its update's 'live_consumers' "
                            "disagrees with the trainer's"
                        )
                    self._seen[consumer] = time.monotonic()
                    if all(n in self._cache for n in names):
                        return [self._cache[n] for n in names]
                    self._check_locked()
                elif self._owes_free(consumer):  # refused; the consumer's failure ends the sync
                    raise ProducerError(
                        f"producer rank {self.rank}, sync {self._sync}: consumer {consumer} "
                        f"pulled for sync {sync_id} while this sync waits for its frees: its "
                        "update's 'sync_id' is not the trainer's"
                    )
                elif time.monotonic() - arrived > self.stall_timeout_s:
                    raise ProducerError(
                        f"producer rank {self.rank}: sync {sync_id} did not begin within "
                        f"{self.stall_timeout_s:g}s of consumer {consumer}'s pull (it is at "
                        f"sync {self._sync}; is the update's 'sync_id' the trainer's?)"
                    )
                self._cond.wait(POLL_S)

    def _refuse_skip(self, consumer: int) -> None:
        """Fail this sync if `consumer`, which skips it, is in its live set."""
        if consumer in self._live and self._error is None:
            self._error = (
                f"producer rank {self.rank}, sync {self._sync}: consumer {consumer} skipped "
                "the sync (its update's 'live_consumers' leaves it out), but the trainer's "
                "live set has it"
            )
            logger.error("%s", self._error)
            self._published, self._cache = {}, {}

    def _owes_free(self, consumer: int) -> bool:
        """Whether this sync, with no error yet, waits for `consumer`'s free of a
        published group. A consumer that finished a sync has freed every group of it
        here (its finish waits for the acknowledgements), so one that owes a free and
        pulls for a later sync was handed a `sync_id` the trainer is not running (or is
        a pull left over from a sync it abandoned)."""
        return (
            self._error is None
            and consumer in self._live
            and any(consumer not in self._freed_by.get(g, ()) for g in self._published)
        )

    def _touch(self) -> None:
        self._progress = time.monotonic()

    def _release_if_done(self, group: int) -> None:
        tensors = self._published.get(group)
        if tensors is None or not self._live <= self._freed_by.get(group, set()):
            return
        del self._published[group]
        for name in tensors:
            self._cache.pop(name, None)
        self._released.append(group)

    def _check_error(self) -> None:
        if self._error is not None:
            raise ProducerError(self._error)

    def _check_locked(self) -> None:
        """Raise the sync's error, or declare one (stall, silent consumer)."""
        self._check_error()
        now = time.monotonic()
        waiting = {g: self._live - self._freed_by.get(g, set()) for g in self._published}
        for group, missing in sorted(waiting.items()):
            for consumer in sorted(missing):
                seen = self._seen.get(consumer)
                if seen is not None and now - seen > self.peer_timeout_s:
                    self._error = (
                        f"producer rank {self.rank}, sync {self._sync}: consumer {consumer} went "
                        f"silent for {now - seen:.0f}s (peer_timeout_s={self.peer_timeout_s:g}) "
                        f"while group {group} waits for its free"
                    )
        if self._error is None and now - self._progress > self.stall_timeout_s:
            stuck = ", ".join(f"group {g} <- consumers {sorted(m)}" for g, m in waiting.items())
            self._error = (
                f"producer rank {self.rank}, sync {self._sync}: no progress for "
                f"{self.stall_timeout_s:g}s (stall_timeout_s); waiting: "
                f"{stuck or 'nothing published'}"
            )
        if self._error is not None:
            logger.error("%s", self._error)
            self._published, self._cache = {}, {}
            self._cond.notify_all()
            raise ProducerError(self._error)
