"""`ProducerActor` / `RDTProducer`: the producer as a Ray actor whose `serve` returns over NIXL.

Imported only by the nixl transport (it imports Ray). The class lives at
module level so that every process can import it by name: a handle resolved
with `ray.get_actor` learns which methods use tensor transport from it.

Ray starts its workers at niceness 15 (its `worker_niceness` setting), below
the trainer (usually 0): where the trainer's node is busy, such an actor gets
a sliver of a core (measured on 2 cores kept busy by 4 processes at
niceness 0: a call needing 20 ms of CPU answered in 1.3 s at 15, in 77 ms at
0), and the trainer, which waits on its answers, stalls. The actor runs at
the trainer's priority where the OS lets it (`match_priority`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from typing import Any

import ray
import torch

from weight_transfer.backend import dtype_from_name
from wt_kits.colocated import SharedSegment
from wt_kits.slices import FetchKey
from wt_sharded_rdt.nixl_progress import poll_not_spin
from wt_sharded_rdt.producer import Producer
from wt_sharded_rdt.transport import StagedTensor

__all__ = ["ProducerActor", "RDTProducer", "match_priority"]


def match_priority(pid: int) -> int:
    """Run every thread of this process at least at process `pid`'s priority (its
    niceness or lower); returns the highest niceness of this process's threads
    after. Raising a priority takes privilege (`CAP_SYS_NICE`, or `RLIMIT_NICE`):
    where the OS refuses, the threads keep theirs (the caller sees it in the
    result). Niceness is per thread on Linux, hence every thread."""
    target = os.getpriority(os.PRIO_PROCESS, pid)
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    highest = target
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            niceness = os.getpriority(os.PRIO_PROCESS, tid)
            if niceness > target:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                    niceness = target
                except PermissionError:
                    pass
            highest = max(highest, niceness)
    return highest


class ProducerActor:
    """The Ray actor around a `Producer` (`wt_sharded_rdt.ray_actor.RDTProducer`).

    It maps the trainer rank's staging segments (checking they belong to the
    trainer's pid and uid) and serves pulls over NIXL.
    """

    def __init__(
        self,
        producer_kwargs: dict[str, Any],
        segment_names: list[str],
        segment_bytes: int,
        trainer_pid: int,
        trainer_uid: int,
    ) -> None:
        self.segments = [
            SharedSegment.attach(name, segment_bytes, owner_pid=trainer_pid, owner_uid=trainer_uid)
            for name in segment_names
        ]
        self.niceness = match_priority(trainer_pid)
        poll_not_spin()  # before this process's first transfer builds its NIXL agent
        self.producer = Producer(**producer_kwargs)
        # (slot, group, start) -> the group's tensors as views of the staging slot
        self.views: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        gc.freeze()  # a full collection must not stall a serve

    def ping(self) -> int:
        return os.getpid()

    def started(self) -> int:
        """This actor's niceness once started (see `match_priority`)."""
        return self.niceness

    def describe(self) -> dict[str, Any]:
        return self.producer.describe()

    def begin_sync(self, sync_id: int, live: list[int]) -> None:
        self.producer.begin_sync(sync_id, live)

    def publish_staged(
        self, slot: int, staged: list[tuple[int, int, list[StagedTensor] | None]]
    ) -> None:
        """Publish the groups the trainer staged in `slot`: per group its index, where
        it starts and its layout (`None`: the same as the last time it started there,
        whose views are kept)."""
        base = self.segments[slot].tensor
        groups: dict[int, dict[str, torch.Tensor]] = {}
        for group, start, layout in staged:
            key = (slot, group, start)
            if layout is not None:
                tensors = {}
                for name, offset, dtype, shape in layout:
                    dt = dtype_from_name(dtype, field="layout dtype")
                    nbytes = math.prod(shape) * dt.itemsize
                    tensors[name] = base[offset : offset + nbytes].view(dt).view(shape)
                self.views[key] = tensors
            elif key not in self.views:
                raise RuntimeError(
                    f"group {group} was staged at byte {start} of slot {slot} without a "
                    "layout, and none was sent before for that place"
                )
            groups[group] = self.views[key]
        self.producer.publish(groups)

    def wait_freed(self, within_s: float) -> list[int]:
        return self.producer.wait_freed(within_s)

    def end_sync(self) -> None:
        self.producer.end_sync()

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        self.producer.set_error(message, sync_id)

    def reserve(self, consumer: int, nbytes: int) -> None:
        self.producer.reserve(consumer, nbytes)

    def free(self, sync_id: int, consumer: int, groups: list[int]) -> bool:
        return self.producer.free(sync_id, consumer, groups)

    def heartbeat(self, sync_id: int, consumer: int) -> None:
        self.producer.heartbeat(sync_id, consumer)

    def skip(self, sync_id: int, consumer: int) -> None:
        self.producer.skip(sync_id, consumer)

    def consumer_failed(self, sync_id: int, consumer: int, message: str) -> None:
        self.producer.consumer_failed(sync_id, consumer, message)

    def serve(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: list[FetchKey],
        expect: list[tuple[str, int]],
    ) -> list[torch.Tensor]:
        return [self.producer.serve(sync_id, consumer, seq, keys, expect)]


class _NixlProducer(ProducerActor):
    @ray.method(tensor_transport="nixl")
    def serve(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: list[FetchKey],
        expect: list[tuple[str, int]],
    ) -> list[torch.Tensor]:
        return super().serve(sync_id, consumer, seq, keys, expect)


RDTProducer: Any = ray.remote(enable_tensor_transport=True)(_NixlProducer)
