"""The nixl carrier: a producer as a Ray actor whose pulls Ray Direct Transport
moves over NIXL (see `wt_sharded_rdt.transport` for the interface).

`RayHost` (the trainer rank's side) starts the actor (`ray_actor.RDTProducer`)
and hands it each span of groups through shared memory, one call a span;
`RayClient` (a consumer's side) reaches it by name. Ray is imported when they are used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backend import dtype_name
from wt_kits.colocated import SharedSegment
from wt_kits.slices import FetchKey
from wt_kits.stream import aligned_layout, floating_runs
from wt_sharded_rdt.nixl_progress import poll_not_spin
from wt_sharded_rdt.transport import (
    ALIVE_TIMEOUT_S,
    CONTROL_TIMEOUT_S,
    Pending,
    Staged,
    StagedTensor,
    check_blob_size,
)

__all__ = ["RayHost", "RayClient"]

logger = logging.getLogger("wt_sharded_rdt")


def _ray_get(ref: Any, timeout_s: float, what: str) -> Any:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g}s") from None


class RayHost:
    """This rank's producer as a Ray actor, fed through shared-memory staging.

    Staged groups are copied into the open slot one after another
    (`aligned_layout`); `publish` hands the slot's groups to the actor in one
    call, and a slot is free again once every group in it is freed. Where each
    group's tensors sit in a slot is the same every sync, so the views it is
    copied through are built once (here and in the actor) and reused."""

    def __init__(
        self,
        name: str,
        namespace: str | None,
        producer_kwargs: dict[str, Any],
        *,
        staging_bytes: int,
        staging_slots: int,
        max_concurrency: int,
        env: Mapping[str, str],
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError(
                "the nixl transport runs on Ray: call ray.init() in the trainer first"
            )
        self.name = name
        self.segments = [SharedSegment.create(max(staging_bytes, 1)) for _ in range(staging_slots)]
        try:
            from wt_sharded_rdt.ray_actor import RDTProducer

            self.actor = RDTProducer.options(
                name=name,
                namespace=namespace,
                num_cpus=0,
                max_concurrency=max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False
                ),
                runtime_env={"env_vars": dict(env)},
            ).remote(
                producer_kwargs,
                [s.name for s in self.segments],
                max(staging_bytes, 1),
                os.getpid(),
                os.getuid(),
            )
            niceness = _ray_get(
                self.actor.started.remote(), CONTROL_TIMEOUT_S, f"producer {name} start"
            )
        except BaseException:
            for segment in self.segments:
                segment.close()
            raise
        for segment in self.segments:
            segment.unlink()  # mapped on both sides: nothing stays in /dev/shm
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if niceness > mine:
            logger.warning(
                "producer %s runs at niceness %d, below this trainer's priority (%d), and "
                "may not raise its own: on a busy node its answers slow down and syncs can "
                "stall. Start Ray's workers at the trainer's niceness (its setting "
                "worker_niceness, e.g. RAY_worker_niceness=0)",
                name, niceness, mine,
            )  # fmt: skip
        # (slot, group, start) -> the staging views of the group's tensors
        self.views: dict[tuple[int, int, int], Staged] = {}
        self.begin_sync_state()

    def begin_sync_state(self) -> None:
        self.free_slots = list(range(len(self.segments)))
        self.open: int | None = None  # the slot being staged into
        self.cursor = 0  # where the next staged group starts in it
        self.staged: list[tuple[int, int, list[StagedTensor] | None]] = []
        self.slot_of: dict[int, int] = {}
        self.unfreed: dict[int, set[int]] = {}  # slot -> its published groups not yet freed

    def describe(self) -> dict[str, Any]:
        return dict(_ray_get(self.actor.describe.remote(), CONTROL_TIMEOUT_S, self.name))

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None:
        self.begin_sync_state()
        _ray_get(self.actor.begin_sync.remote(sync_id, list(live)), CONTROL_TIMEOUT_S, self.name)

    def stage(self, group: int, tensors: dict[str, torch.Tensor]) -> Staged:
        if self.open is None:
            if not self.free_slots:
                raise RuntimeError(f"{self.name}: no free staging slot (spans out of step)")
            self.open, self.cursor = self.free_slots.pop(0), 0
        slot, start = self.open, self.cursor
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, self.cursor = aligned_layout(sizes, start)
        base = self.segments[slot].tensor
        if self.cursor > base.numel():
            raise RuntimeError(
                f"{self.name}: group {group} ends at byte {self.cursor} of a staging slot "
                f"of {base.numel()} (spans larger than planned)"
            )
        key = (slot, group, start)
        staged = self.views.get(key)
        layout: list[StagedTensor] | None = None
        if staged is None:  # first time here: build the views, tell the actor the layout
            views, layout, pieces = [], [], []
            for (name, t), offset, nbytes in zip(tensors.items(), offsets, sizes, strict=True):
                views.append(base[offset : offset + nbytes].view(t.dtype).view(t.shape))
                layout.append((name, offset, dtype_name(t.dtype), list(t.shape)))
                pieces.append((t.dtype, offset, nbytes))
            staged = self.views[key] = Staged(
                views, [base[a:b].view(dt) for dt, a, b in floating_runs(pieces)]
            )
        with torch.no_grad():
            torch._foreach_copy_(staged.tensors, list(tensors.values()))
        self.staged.append((group, start, layout))
        self.slot_of[group] = slot
        return staged

    def publish(self) -> None:
        if self.open is None:
            return
        slot, staged = self.open, self.staged
        self.open, self.staged = None, []
        self.unfreed[slot] = {group for group, _, _ in staged}
        _ray_get(self.actor.publish_staged.remote(slot, staged), CONTROL_TIMEOUT_S, self.name)

    def wait_freed(self, within_s: float) -> list[int]:
        groups = _ray_get(
            self.actor.wait_freed.remote(within_s), within_s + CONTROL_TIMEOUT_S, self.name
        )
        for group in groups:
            slot = self.slot_of.pop(group)
            unfreed = self.unfreed[slot]
            unfreed.discard(group)
            if not unfreed:
                del self.unfreed[slot]
                self.free_slots.append(slot)
        return list(groups)

    def end_sync(self, within_s: float) -> None:
        _ray_get(self.actor.end_sync.remote(), within_s, self.name)

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        import ray

        ray.get(self.actor.set_error.remote(message, sync_id), timeout=CONTROL_TIMEOUT_S)

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        finally:
            for segment in self.segments:
                segment.close()
            self.segments = []


class _RayPull:
    def __init__(self, ref: Any, into: torch.Tensor, what: str) -> None:
        self.ref, self.into, self.what = ref, into, what  # `into` stays referenced (Ray's is weak)

    def result(self, timeout_s: float) -> Any:
        (blob,) = _ray_get(self.ref, timeout_s, self.what)
        check_blob_size(blob, self.into, self.what)
        if blob.data_ptr() != self.into.data_ptr():  # landed elsewhere: copy it in
            self.into.copy_(blob)
        return None


class _RayResult:
    def __init__(self, ref: Any, what: str) -> None:
        self.ref, self.what = ref, what

    def result(self, timeout_s: float) -> Any:
        return _ray_get(self.ref, timeout_s, self.what)


class RayClient:
    """A consumer's handle on a producer actor, found by name."""

    def __init__(self, name: str, namespace: str | None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "the nixl transport runs on Ray: this inference process is not connected to a "
                "Ray cluster (run it in a Ray actor, or ray.init(address=...) first)"
            )
        try:
            self.actor = ray.get_actor(name, namespace=namespace)
        except ValueError as error:
            raise RuntimeError(
                f"producer actor {name!r} (namespace {namespace!r}) not found: {error}"
            ) from None
        # Handles resolved by name do not carry the class's tensor-transport
        # flag; the producer class has it, so the handle may use it too.
        self.actor._ray_enable_tensor_transport = True
        self.name = name
        poll_not_spin()  # before this process's first pull builds its NIXL agent

    def describe(self) -> dict[str, Any]:
        return dict(_ray_get(self.actor.describe.remote(), CONTROL_TIMEOUT_S, self.name))

    def reserve(self, consumer: int, nbytes: int) -> None:
        _ray_get(self.actor.reserve.remote(consumer, nbytes), CONTROL_TIMEOUT_S, self.name)

    def pull(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: Sequence[FetchKey],
        expect: Sequence[tuple[str, int]],
        into: torch.Tensor,
    ) -> Pending:
        from ray.experimental import set_target_for_ref

        ref = self.actor.serve.remote(sync_id, consumer, seq, list(keys), list(expect))
        set_target_for_ref(ref, [into])
        return _RayPull(ref, into, f"pull {seq} from {self.name}")

    def free(self, sync_id: int, consumer: int, groups: Sequence[int]) -> Pending:
        ref = self.actor.free.remote(sync_id, consumer, list(groups))
        return _RayResult(ref, f"free to {self.name}")

    def heartbeat(self, sync_id: int, consumer: int) -> None:
        self.actor.heartbeat.remote(sync_id, consumer)

    def skip(self, sync_id: int, consumer: int) -> None:
        self.actor.skip.remote(sync_id, consumer)

    def consumer_failed(self, sync_id: int, consumer: int, message: str) -> None:
        self.actor.consumer_failed.remote(sync_id, consumer, message)

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        self.actor.set_error.remote(message, sync_id)

    def alive(self) -> bool:
        try:
            _ray_get(self.actor.ping.remote(), ALIVE_TIMEOUT_S, self.name)
        except Exception:
            return False
        return True
