"""How a trainer rank hosts its producer and how consumers reach producers.

Two transports, one interface, so the whole pipeline (plan, routing, replay,
layout, scatter) is the same code whichever carries the bytes:

- `loopback`: the producer lives in the trainer rank's process, registered
  by name in a process-wide table; a consumer in the same process calls it
  directly and copies the blob into its receive slot. For tests and for
  trainer and inference in one process.
- `nixl`: the producer is a Ray actor (`ProducerActor`) on the trainer
  rank's node, named so consumers find it (`ray.get_actor`). The rank hands
  it each group through shared memory (core's `SharedSegment`, a ring of
  `gather_lookahead + 1` slots, each sized for the rank's largest group); a
  consumer's pull is an actor call whose returned tensor Ray Direct
  Transport moves over NIXL straight into the consumer's receive slot
  (`set_target_for_ref`). Consumers pull; the trainer never routes.

Trainer side (`ProducerHost`): `describe`, `begin_sync`, `publish`,
`wait_freed`, `end_sync`, `set_error`, `close`. Consumer side
(`ProducerClient`): `pull` (returns a `Pending` whose `result(timeout_s)`
returns once the bytes are in the receive slot, and raises if the blob is not
the size the consumer planned), `free`, `heartbeat`, `skip`,
`consumer_failed`, `reserve`, `describe`. Every call that waits takes a timeout.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from weight_transfer.backend import (
    FetchKey,
    SharedSegment,
    aligned_layout,
    dtype_from_name,
    dtype_name,
)
from wt_sharded_rdt.producer import Producer

__all__ = [
    "ProducerHost",
    "ProducerClient",
    "Pending",
    "host_producer",
    "producer_client",
    "ray_location",
    "ProducerActor",
    "forwarded_env",
]

# Control calls to a producer answer at once; waits pass their own bound.
CONTROL_TIMEOUT_S = 60.0
ALIVE_TIMEOUT_S = 5.0
ENV_PREFIXES = ("UCX_", "NIXL_")


class Pending(Protocol):
    def result(self, timeout_s: float) -> Any: ...


class ProducerHost(Protocol):
    name: str

    def describe(self) -> dict[str, Any]: ...

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None: ...

    def publish(self, group: int, tensors: dict[str, torch.Tensor]) -> None: ...

    def wait_freed(self, within_s: float) -> list[int]: ...

    def end_sync(self, within_s: float) -> None: ...

    def set_error(self, message: str, sync_id: int | None = None) -> None: ...

    def close(self) -> None: ...


class ProducerClient(Protocol):
    name: str

    def describe(self) -> dict[str, Any]: ...

    def reserve(self, consumer: int, nbytes: int) -> None: ...

    def pull(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: Sequence[FetchKey],
        expect: Sequence[tuple[str, int]],
        into: torch.Tensor,
    ) -> Pending: ...

    def free(self, sync_id: int, consumer: int, group: int) -> Pending: ...

    def heartbeat(self, sync_id: int, consumer: int) -> None: ...

    def skip(self, sync_id: int, consumer: int) -> None: ...

    def consumer_failed(self, sync_id: int, consumer: int, message: str) -> None: ...

    def set_error(self, message: str, sync_id: int | None = None) -> None: ...

    def alive(self) -> bool: ...


def check_blob_size(blob: torch.Tensor, into: torch.Tensor, what: str) -> None:
    """Refuse a blob whose length is not the planned one (the producer and the
    consumer's handshake disagree about what it holds) before it lands anywhere."""
    if blob.numel() != into.numel():
        raise ValueError(
            f"{what}: the producer sent {blob.numel()} bytes, the consumer's plan (from its "
            f"handshake) expects {into.numel()}"
        )


def forwarded_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The trainer's UCX/NIXL settings plus `extra`, for the producer actor."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    env.update(extra or {})
    return env


# -- loopback ---------------------------------------------------------------------
_LOOPBACK: dict[tuple[str | None, str], Producer] = {}
_LOOPBACK_LOCK = threading.Lock()


class _Done:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def result(self, timeout_s: float) -> Any:
        return self.value


class _FutureResult:
    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self.future = future

    def result(self, timeout_s: float) -> Any:
        try:
            return self.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {timeout_s:g}s") from None


class LoopbackHost:
    """A producer in this process, found by name (see the module docstring)."""

    def __init__(self, name: str, namespace: str | None, producer: Producer) -> None:
        self.name, self.namespace, self.producer = name, namespace, producer
        with _LOOPBACK_LOCK:
            if (namespace, name) in _LOOPBACK:
                raise ValueError(f"a producer named {name!r} already exists in this process")
            _LOOPBACK[(namespace, name)] = producer

    def describe(self) -> dict[str, Any]:
        return self.producer.describe()

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None:
        self.producer.begin_sync(sync_id, live)

    def publish(self, group: int, tensors: dict[str, torch.Tensor]) -> None:
        self.producer.publish(group, tensors)

    def wait_freed(self, within_s: float) -> list[int]:
        return self.producer.wait_freed(within_s)

    def end_sync(self, within_s: float) -> None:
        self.producer.end_sync()

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        self.producer.set_error(message, sync_id)

    def close(self) -> None:
        self.producer.set_error("the trainer engine was shut down")
        with _LOOPBACK_LOCK:
            if _LOOPBACK.get((self.namespace, self.name)) is self.producer:
                del _LOOPBACK[(self.namespace, self.name)]


class LoopbackClient:
    """A consumer's handle on a producer of this process."""

    def __init__(self, name: str, namespace: str | None) -> None:
        with _LOOPBACK_LOCK:
            producer = _LOOPBACK.get((namespace, name))
        if producer is None:
            raise RuntimeError(
                f"no producer named {name!r} in this process (loopback transport: the trainer "
                "and the consumer must share a process)"
            )
        self.name, self.producer = name, producer
        self.pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="wt-rdt-pull")

    def describe(self) -> dict[str, Any]:
        return self.producer.describe()

    def reserve(self, consumer: int, nbytes: int) -> None:
        self.producer.reserve(consumer, nbytes)

    def pull(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: Sequence[FetchKey],
        expect: Sequence[tuple[str, int]],
        into: torch.Tensor,
    ) -> Pending:
        def run() -> None:
            blob = self.producer.serve(sync_id, consumer, seq, keys, expect)
            check_blob_size(blob, into, f"pull {seq} from {self.name}")
            into.copy_(blob)

        return _FutureResult(self.pool.submit(run))

    def free(self, sync_id: int, consumer: int, group: int) -> Pending:
        return _Done(self.producer.free(sync_id, consumer, group))

    def heartbeat(self, sync_id: int, consumer: int) -> None:
        self.producer.heartbeat(sync_id, consumer)

    def skip(self, sync_id: int, consumer: int) -> None:
        self.producer.skip(sync_id, consumer)

    def consumer_failed(self, sync_id: int, consumer: int, message: str) -> None:
        self.producer.consumer_failed(sync_id, consumer, message)

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        self.producer.set_error(message, sync_id)

    def alive(self) -> bool:
        with _LOOPBACK_LOCK:
            return any(p is self.producer for p in _LOOPBACK.values())


# -- Ray + NIXL -----------------------------------------------------------------------
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
        self.producer = Producer(**producer_kwargs)
        gc.freeze()  # a full collection must not stall a serve

    def ping(self) -> int:
        return os.getpid()

    def describe(self) -> dict[str, Any]:
        return self.producer.describe()

    def begin_sync(self, sync_id: int, live: list[int]) -> None:
        self.producer.begin_sync(sync_id, live)

    def publish_staged(
        self, group: int, slot: int, layout: list[tuple[str, int, str, list[int]]]
    ) -> None:
        base = self.segments[slot].tensor
        tensors = {}
        for name, offset, dtype, shape in layout:
            dt = dtype_from_name(dtype, field="layout dtype")
            nbytes = math.prod(shape) * dt.itemsize
            tensors[name] = base[offset : offset + nbytes].view(dt).view(shape)
        self.producer.publish(group, tensors)

    def wait_freed(self, within_s: float) -> list[int]:
        return self.producer.wait_freed(within_s)

    def end_sync(self) -> None:
        self.producer.end_sync()

    def set_error(self, message: str, sync_id: int | None = None) -> None:
        self.producer.set_error(message, sync_id)

    def reserve(self, consumer: int, nbytes: int) -> None:
        self.producer.reserve(consumer, nbytes)

    def free(self, sync_id: int, consumer: int, group: int) -> bool:
        return self.producer.free(sync_id, consumer, group)

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


def _ray_get(ref: Any, timeout_s: float, what: str) -> Any:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g}s") from None


class RayHost:
    """This rank's producer as a Ray actor, fed through shared-memory staging."""

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
            _ray_get(self.actor.ping.remote(), CONTROL_TIMEOUT_S, f"producer {name} start")
        except BaseException:
            for segment in self.segments:
                segment.close()
            raise
        for segment in self.segments:
            segment.unlink()  # mapped on both sides: nothing stays in /dev/shm
        self.free_slots = list(range(staging_slots))
        self.slot_of: dict[int, int] = {}

    def describe(self) -> dict[str, Any]:
        return dict(_ray_get(self.actor.describe.remote(), CONTROL_TIMEOUT_S, self.name))

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None:
        self.free_slots = list(range(len(self.segments)))
        self.slot_of = {}
        _ray_get(self.actor.begin_sync.remote(sync_id, list(live)), CONTROL_TIMEOUT_S, self.name)

    def publish(self, group: int, tensors: dict[str, torch.Tensor]) -> None:
        if not self.free_slots:
            raise RuntimeError(f"{self.name}: no free staging slot (gather credits out of step)")
        slot = self.free_slots.pop(0)
        base = self.segments[slot].tensor
        names = list(tensors)
        offsets, _ = aligned_layout([t.numel() * t.element_size() for t in tensors.values()])
        layout = []
        for name, offset in zip(names, offsets, strict=True):
            t = tensors[name]
            nbytes = t.numel() * t.element_size()
            if nbytes:
                base[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
            layout.append((name, offset, dtype_name(t.dtype), list(t.shape)))
        self.slot_of[group] = slot
        _ray_get(
            self.actor.publish_staged.remote(group, slot, layout), CONTROL_TIMEOUT_S, self.name
        )

    def wait_freed(self, within_s: float) -> list[int]:
        groups = _ray_get(
            self.actor.wait_freed.remote(within_s), within_s + CONTROL_TIMEOUT_S, self.name
        )
        for group in groups:
            self.free_slots.append(self.slot_of.pop(group))
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

    def free(self, sync_id: int, consumer: int, group: int) -> Pending:
        return _RayResult(self.actor.free.remote(sync_id, consumer, group), f"free to {self.name}")

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


def host_producer(
    transport: str,
    name: str,
    namespace: str | None,
    producer_kwargs: dict[str, Any],
    *,
    staging_bytes: int,
    staging_slots: int,
    max_concurrency: int,
    env: Mapping[str, str],
) -> ProducerHost:
    if transport == "loopback":
        return LoopbackHost(name, namespace, Producer(**producer_kwargs))
    return RayHost(
        name,
        namespace,
        producer_kwargs,
        staging_bytes=staging_bytes,
        staging_slots=staging_slots,
        max_concurrency=max_concurrency,
        env=env,
    )


def producer_client(
    transport: str, name: str, namespace: str | None, ray_address: str | None = None
) -> ProducerClient:
    """A handle on producer `name`. For nixl, a process not yet on Ray (a worker
    process of vLLM's own executor) joins the cluster at `ray_address` first."""
    if transport == "loopback":
        return LoopbackClient(name, namespace)
    import ray

    if not ray.is_initialized() and ray_address:
        ray.init(address=ray_address, namespace=namespace, log_to_driver=False)
    return RayClient(name, namespace)


def ray_location(namespace: str | None) -> tuple[str, str]:
    """The Ray namespace producers are named in (this job's unless given) and the
    cluster's address, for the handshake."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the nixl transport runs on Ray: call ray.init() in the trainer first")
    context = ray.get_runtime_context()
    return namespace or context.namespace, context.gcs_address
