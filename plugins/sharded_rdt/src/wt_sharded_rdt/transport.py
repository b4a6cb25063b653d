"""The interface between a trainer rank's producer and its consumers, and its loopback carrier.

`wt_sharded_rdt.links` picks the carrier by name.

Two transports, one interface, so the whole pipeline (plan, routing, replay,
layout, scatter) is the same code whichever carries the bytes:

- `loopback`: the producer lives in the trainer rank's process, registered
  by name in a process-wide table; a consumer in the same process calls it
  directly and copies the blob into its receive slot. For tests and for
  trainer and inference in one process.
- `nixl` (`wt_sharded_rdt.nixl`): the producer is a Ray actor
  (`wt_sharded_rdt.ray_actor.ProducerActor`) on the trainer
  rank's node, named so consumers find it (`ray.get_actor`). The rank hands
  it each span of groups through shared memory (the kits' `SharedSegment`,
  two slots, each sized for the rank's largest span); a
  consumer's pull is an actor call whose returned tensor Ray Direct
  Transport moves over NIXL straight into the consumer's receive slot
  (`set_target_for_ref`). Consumers pull; the trainer never routes.

Trainer side (`ProducerHost`): `describe`, `begin_sync`, `stage` (local: holds
or copies a group's tensors), `publish` (the staged groups, one call),
`wait_freed`, `end_sync`, `set_error`, `close`. Consumer side
(`ProducerClient`): `pull` (returns a `Pending` whose `result(timeout_s)`
returns once the bytes are in the receive slot, and raises if the blob is not
the size the consumer planned), `free`, `heartbeat`, `skip`,
`consumer_failed`, `reserve`, `describe`. Every call that waits takes a timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from wt_kits.slices import FetchKey
from wt_sharded_rdt.producer import Producer

__all__ = [
    "ProducerHost",
    "ProducerClient",
    "Pending",
    "LoopbackHost",
    "LoopbackClient",
    "check_blob_size",
    "forwarded_env",
    "Staged",
    "StagedTensor",
]

# Control calls to a producer answer at once; waits pass their own bound.
CONTROL_TIMEOUT_S = 60.0
ALIVE_TIMEOUT_S = 5.0
ENV_PREFIXES = ("UCX_", "NIXL_")

# Where a staged tensor sits in a staging slot: (name, byte offset, dtype name, shape)
StagedTensor = tuple[str, int, str, list[int]]


class Staged(NamedTuple):
    """A staged group: what will be served, in order (the source's tensors or their
    copies), and the same bytes' floating values as few tensors as their layout
    allows (adjacent copies of one dtype as one run), for the finite check."""

    tensors: list[torch.Tensor]
    floating: list[torch.Tensor]


class Pending(Protocol):
    def result(self, timeout_s: float) -> Any: ...


class ProducerHost(Protocol):
    name: str

    def describe(self) -> dict[str, Any]: ...

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None: ...

    def stage(self, group: int, tensors: dict[str, torch.Tensor]) -> Staged:
        """Take `group`'s tensors for the next `publish` (no call to the producer)."""
        ...

    def publish(self) -> None:
        """Make every group staged since the last publish servable, in one call."""
        ...

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

    def free(self, sync_id: int, consumer: int, groups: Sequence[int]) -> Pending: ...

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
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        with _LOOPBACK_LOCK:
            if (namespace, name) in _LOOPBACK:
                raise ValueError(f"a producer named {name!r} already exists in this process")
            _LOOPBACK[(namespace, name)] = producer

    def describe(self) -> dict[str, Any]:
        return self.producer.describe()

    def begin_sync(self, sync_id: int, live: Sequence[int]) -> None:
        self.staged = {}
        self.producer.begin_sync(sync_id, live)

    def stage(self, group: int, tensors: dict[str, torch.Tensor]) -> Staged:
        self.staged[group] = tensors
        held = list(tensors.values())
        return Staged(held, held)

    def publish(self) -> None:
        staged, self.staged = self.staged, {}
        if staged:
            self.producer.publish(staged)

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

    def free(self, sync_id: int, consumer: int, groups: Sequence[int]) -> Pending:
        return _Done(self.producer.free(sync_id, consumer, list(groups)))

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
