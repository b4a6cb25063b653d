"""What the wt-ipc tests share: /dev/shm listings, clients that rewrite payloads or reach
restarted workers, and restarting a worker process of a `WorkerPool` in its place."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

from tests.harness import (
    FanoutClient,
    RecordingClient,
    WorkerPool,
    WorkerSpec,
    _serve,
    worker_context,
)
from weight_transfer.runtime.control import SEAL_FIELD, ControlKey

Rewrite = Callable[[dict[str, Any]], Any]


def our_segments(pid: int | None = None) -> list[str]:
    """Names in /dev/shm that a wt process (`pid`, default: any) created."""
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/wt-{pid or '*'}-*"))


def mapped_segments(pid: int) -> set[str]:
    """The wt segment names process `pid` maps (unlinked ones included)."""
    with open(f"/proc/{pid}/maps") as f:
        return {
            os.path.basename(line.split()[5])
            for line in f
            if len(line.split()) > 5 and "/dev/shm/wt-" in line
        }


class Tampering(RecordingClient):
    """Records, then rewrites the handshake (`init`) or the update info (`update`) on its
    way to the workers; either may be changed between calls. A rewritten update is
    signed again with the key of the last trainer built on this client (which its
    `RoundClient` binds here): a control plane that holds the key, so that what the
    backend itself checks is what refuses it."""

    def __init__(self, inner: Any, init: Rewrite | None = None, update: Rewrite | None = None):
        super().__init__(inner)
        self.init = init
        self.update = update
        self.key: ControlKey | None = None

    def bind_control(self, key: ControlKey) -> None:
        self.key = key

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.payloads.append(init_info)
        self.inner.init_weight_transfer_engine(self.init(init_info) if self.init else init_info)

    def update_weights(self, update_info: Any) -> None:
        sealing = isinstance(update_info, dict) and SEAL_FIELD in update_info
        (self.seals if sealing else self.payloads).append(update_info)
        if self.update is not None and not sealing:
            update_info = self.update(update_info)
            if self.key is not None:
                update_info = self.key.sign(update_info)
        self.inner.update_weights(update_info)

    @property
    def handshakes(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if isinstance(p, dict) and "control_path" in p]


class FreshClient:
    """A fan-out client that connects anew for every call, to the pool's addresses as
    they are then (as an HTTP client reaches a server restarted on its address)."""

    def __init__(self, pool: WorkerPool, timeout_s: float = 60.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> None:
        FanoutClient(list(self.pool.addresses), self.timeout_s).call(method, *args)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def start_worker(pool: WorkerPool, i: int, model_factory: str | None) -> Any:
    """A fresh `ipc` worker process for rank `i` of `pool`, put in the place of its worker
    `i` (the process there before is returned, alive or not; the pool stops the new one)."""
    ctx = worker_context()
    parent, child = ctx.Pipe()
    spec = WorkerSpec(
        "ipc", i, len(pool.processes), model_factory=model_factory, env=dict(os.environ)
    )
    process = ctx.Process(target=_serve, args=(spec, child), daemon=True)
    process.start()
    if not parent.poll(120):
        process.kill()
        raise TimeoutError(f"the restarted worker {i} did not start within 120s")
    status, address = parent.recv()
    if status != "ok":
        process.kill()
        raise RuntimeError(f"the restarted worker {i} failed to start: {address}")
    old = pool.processes[i]
    pool.processes[i], pool.addresses[i] = process, address
    return old
