"""Inference-worker processes for the benchmark: a plain target model each, on loopback.

`WorkerProcesses(layout, n)` spawns `n` processes. Each builds a plain module
holding one parameter per entry of `layout` (dotted names become submodules)
and serves calls on a `multiprocessing.connection` listener on 127.0.0.1.
Per backend it creates that backend's worker engine through the engine
factory (position: rank `i` of `n`) inside a `WorkerSession`, one engine per
key, so two modes of a backend each have their own; the model loads
by copying each tensor into its parameter in place, with no undo copy, so
what is timed is the transport. `client(backend)` is a
`VLLMWeightSyncClient` that calls every worker at once and waits for all
(bounded); `call(method, ...)` reaches the other services: a bare gloo
group (`bare_join`, then `bare_broadcast` of the joined size, the
transport's ceiling, then `bare_leave`), a checksum of the model, the peak
resident memory, a round's counted costs (`count_costs`, `costs`:
`wt_tools.costs.worker_counters`). Processes are stopped by PID on `close()`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

__all__ = ["WorkerProcesses", "checksum", "peak_rss_bytes", "reset_peak_rss", "build_target"]

AUTHKEY = b"wt-bench"
CALL_TIMEOUT_S = 900.0
LayoutEntry = tuple[str, tuple[int, ...], str]


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """A cheap fingerprint of the bytes of `tensors` (sum of words, and of every 7th times 3)."""
    total = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        words = flat.view(torch.int16 if t.element_size() == 2 else torch.int32)
        total += int(words.sum(dtype=torch.int64)) + 3 * int(words[::7].sum(dtype=torch.int64))
    return total


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    """This process's resident memory now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident memory since the last `reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> int:
    """Reset the peak to the current resident memory; returns that (bytes)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def build_target(layout: Sequence[LayoutEntry], device: str = "cpu") -> torch.nn.Module:
    """A module with one zero parameter per layout entry (on `device`), under its dotted name."""
    from weight_transfer.backend import dtype_from_name

    root = torch.nn.Module()
    for name, shape, dtype in layout:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = getattr(module, part, None)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        tensor = torch.zeros(shape, dtype=dtype_from_name(dtype, field="layout"), device=device)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def _serve(
    layout: list[LayoutEntry], rank: int, n: int, env: dict[str, str], device: str, ready: Any
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    from weight_transfer import (
        WeightTransferConfig,
        WeightTransferEngineFactory,
        WorkerPosition,
        WorkerSession,
    )
    from weight_transfer.backend import DirectLoader
    from weight_transfer.loading import register_loader_provider
    from wt_kits.group import StatelessGroup
    from wt_tools.costs import worker_counters

    model = build_target(layout, device)
    register_loader_provider(lambda m, _: DirectLoader(m, undo=False) if m is model else None)
    sessions: dict[str, WorkerSession] = {}

    def session(backend: str, key: str) -> WorkerSession:
        if key not in sessions:
            engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend), WorkerPosition(rank, n), device, model
            )
            sessions[key] = WorkerSession(engine)
        return sessions[key]

    bare: dict[str, Any] = {}

    def bare_join(port: int, secret: str, nbytes: int, chunk: int) -> None:
        bare["group"] = StatelessGroup.create(
            host="127.0.0.1", port=port, rank=rank + 1, world_size=n + 1, secret=secret,
            timeout_s=300.0, name="bare",
        )  # fmt: skip
        bare["buffer"], bare["nbytes"], bare["chunk"] = (
            torch.zeros(min(nbytes, chunk), dtype=torch.uint8), nbytes, chunk,
        )  # fmt: skip

    def bare_broadcast() -> None:
        group, buffer, nbytes, chunk = bare["group"], bare["buffer"], bare["nbytes"], bare["chunk"]
        for start in range(0, nbytes, chunk):
            size = min(chunk, nbytes - start)
            group.wait(group.broadcast(buffer[:size]), "the bare broadcast")

    services: dict[str, Callable[..., Any]] = {
        "checksum": lambda: checksum([p for _, p in model.named_parameters()]),
        "reset_peak": reset_peak_rss,
        "peak_rss": peak_rss_bytes,
        "bare_join": bare_join,
        "bare_broadcast": bare_broadcast,
        "bare_leave": lambda: bare.pop("group").close(),
        **worker_counters(),
    }
    with Listener(("127.0.0.1", 0), authkey=AUTHKEY) as listener:
        ready.put(listener.address)
        with listener.accept() as conn:
            while True:
                method, backend, key, args = conn.recv()
                if method == "stop":
                    for s in sessions.values():
                        with contextlib.suppress(Exception):
                            s.engine.shutdown()
                    conn.send(("ok", None))
                    return
                try:
                    if backend is None:
                        result = services[method](*args)
                    else:
                        result = getattr(session(backend, key), method)(*args)
                    conn.send(("ok", result))
                except Exception as error:
                    conn.send(("err", f"{type(error).__name__}: {error}"))


class _BackendClient:
    """The workers as one `VLLMWeightSyncClient` for `backend` (their engines under `key`)."""

    def __init__(self, pool: WorkerProcesses, backend: str, key: str) -> None:
        self.pool, self.engine = pool, (backend, key)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.pool.call("init_weight_transfer_engine", init_info, engine=self.engine)

    def start_weight_update(self) -> None:
        self.pool.call("start_weight_update", engine=self.engine)

    def update_weights(self, update_info: Any) -> None:
        self.pool.call("update_weights", update_info, engine=self.engine)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.pool.call("finish_weight_update", weight_version, engine=self.engine)


class WorkerProcesses:
    """See the module docstring; use as a context manager."""

    def __init__(
        self,
        layout: Sequence[LayoutEntry],
        n: int,
        env: dict[str, str] | None = None,
        device: str = "cpu",
    ) -> None:
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self.processes = [
            ctx.Process(
                target=_serve, args=(list(layout), r, n, env or {}, device, ready), daemon=True
            )
            for r in range(n)
        ]
        for p in self.processes:
            p.start()
        try:
            addresses = [ready.get(timeout=120) for _ in range(n)]
            self.conns: list[Connection] = [Client(a, authkey=AUTHKEY) for a in addresses]
        except BaseException:
            self.close()
            raise

    def client(self, backend: str, key: str | None = None) -> _BackendClient:
        """A client for `backend`'s engines (one per `key`, by default the backend's name)."""
        return _BackendClient(self, backend, key or backend)

    def call(self, method: str, *args: Any, engine: tuple[str, str] | None = None) -> list[Any]:
        """`method` on every worker at once (on its engine `(backend, key)`, or one of the
        services); raises naming the first worker that failed."""
        backend, key = engine if engine is not None else (None, None)
        for conn in self.conns:
            conn.send((method, backend, key, args))
        results: list[Any] = []
        deadline = time.monotonic() + CALL_TIMEOUT_S
        failure: str | None = None
        for i, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"worker {i}: no answer to {method} within {CALL_TIMEOUT_S:g}s")
            status, value = conn.recv()
            if status == "err" and failure is None:
                failure = f"worker {i}: {value}"
            results.append(value)
        if failure is not None:
            raise RuntimeError(f"{method} failed on {failure}")
        return results

    def close(self) -> None:
        for conn in getattr(self, "conns", []):
            with contextlib.suppress(Exception):
                conn.send(("stop", None, None, ()))
                conn.poll(10)
        for p in self.processes:
            p.join(10)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
                p.join(5)

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
