"""Real inference-worker processes for backend tests, reached over loopback sockets.

`WorkerPool(backend, n)` spawns `n` OS processes. Each creates its engine
through `WeightTransferEngineFactory` (so entry points are exercised), wraps it
in a `WorkerSession` (the same state machine vLLM's worker runs) and serves
calls on a `multiprocessing.connection` listener bound to 127.0.0.1.
`pool.client()` returns a `VLLMWeightSyncClient` that fans every call out to
all workers and blocks on all of them, with a timeout; it is picklable, so a
trainer in another process can use it.

The model in each worker is a `RecordingModel`: its `load_weights` keeps the
tensors it is handed *by reference* until every name of their layer
(`layerwise_groups`) has arrived and only then copies them, which is how
vLLM's layerwise reload treats loader arguments. A backend that reuses a
buffer too early therefore records wrong values. With
`model_factory="module:function"` (importable in the child) each worker builds
that model instead; `pool.each("state_dict")` returns its parameters, and
`pool.each("weights")` the fingerprints of what the worker holds (what it
received for a `RecordingModel`, its parameters otherwise). With
`handlers="module:function"` each worker also serves the methods that
`function(model, session)` returns (a dict of name -> callable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from weight_transfer.runtime.control import SEAL_FIELD

AUTHKEY = b"wt-testing"
STOP = "wt-stop-serving"  # ends an in-process worker (`WorkerPool(in_process=True)`)
CALL_TIMEOUT_S = 120.0


class RecordingModel(torch.nn.Module):
    """Records what `load_weights` receives, holding references until a layer completes.

    `fail_on`: a name whose arrival raises (as an unknown parameter would).
    `load_delay_s`: sleep per `load_weights` call (to widen a race window).
    """

    def __init__(
        self,
        names: list[str] | None = None,
        *,
        fail_on: str | None = None,
        load_delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        from weight_transfer import layerwise_groups

        self.fail_on = fail_on
        self.load_delay_s = load_delay_s
        self.group_of: dict[str, int] = {}
        self.group_sizes: list[int] = []
        if names is not None:
            self.set_names(names)
        self.held: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.received: dict[str, torch.Tensor] = {}
        self.load_calls = 0
        self._layerwise_groups = layerwise_groups

    def set_names(self, names: list[str]) -> None:
        """Declare the parameter names (their layers) and forget what was received."""
        from weight_transfer import layerwise_groups

        self.held, self.received = {}, {}
        self.group_of, self.group_sizes = {}, []
        for gi, group in enumerate(layerwise_groups(names)):
            self.group_sizes.append(len(group))
            for n in group:
                self.group_of[n] = gi

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.load_calls += 1
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        loaded = set()
        for name, tensor in weights:
            if name == self.fail_on:
                raise ValueError(f"RecordingModel has no parameter named {name!r}")
            gi = self.group_of.get(name, -1)
            if gi < 0:  # names not declared up front are copied at once
                self.received[name] = tensor.clone()
            else:
                held = self.held.setdefault(gi, [])
                if any(n == name for n, _ in held):  # a new round after an aborted one
                    held.clear()
                held.append((name, tensor))
                if len(held) == self.group_sizes[gi]:
                    for n, t in self.held.pop(gi):
                        self.received[n] = t.clone()
            loaded.add(name)
        return loaded


@dataclass
class WorkerSpec:
    backend: str
    rank: int
    world_size: int
    names: list[str] | None = None
    fail_on: str | None = None
    load_delay_s: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    model_factory: str | None = None
    device: str = "cpu"
    sys_path: list[str] = field(default_factory=list)
    handlers: str | None = None


def worker_context() -> Any:
    """Where worker processes come from: a fork server that imported torch and this
    module once, so a worker starts without importing them again (about 1.5 s of
    CPU each). A worker gets the environment of the moment it was started
    (`WorkerSpec.env`), as a spawned one would."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", __name__])
    return ctx


def load_object(target: str) -> Any:
    """The object `"module:name"` names."""
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _make_model(spec: WorkerSpec) -> Any:
    """`RecordingModel`, or the model `spec.model_factory` ("module:function") builds."""
    if spec.model_factory is None:
        return RecordingModel(spec.names, fail_on=spec.fail_on, load_delay_s=spec.load_delay_s)
    return load_object(spec.model_factory)()


def _fingerprints(model: Any) -> dict[str, str]:
    if isinstance(model, RecordingModel):
        return {n: _digest(t) for n, t in model.received.items()}
    return {n: _digest(p) for n, p in model.named_parameters()}


def _serve(spec: WorkerSpec, ready: Any) -> None:
    import sys

    sys.path[:0] = spec.sys_path
    os.environ.update(spec.env)
    torch.set_num_threads(1)
    from weight_transfer import (
        WeightTransferConfig,
        WeightTransferEngineFactory,
        WorkerPosition,
        WorkerSession,
    )

    model = _make_model(spec)
    try:
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(spec.backend),
            WorkerPosition(rank=spec.rank, world_size=spec.world_size),
            spec.device,
            model,
        )
    except Exception as e:
        ready.send(("err", f"{type(e).__name__}: {e}"))
        return
    session = WorkerSession(engine)
    lock = threading.Lock()
    extra = load_object(spec.handlers)(model, session) if spec.handlers else {}
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    stopping = threading.Event()
    ready.send(("ok", listener.address))

    def local(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method == STOP:  # an in-process worker: its thread ends, its engine shuts down
            stopping.set()
            # a connection wakes the accept below (closing the listener would not)
            with contextlib.suppress(OSError, EOFError):
                Client(listener.address, authkey=AUTHKEY).close()
            session.shutdown_weight_transfer_engine()
            return None
        if method == "received":
            return {n: t.clone() for n, t in model.received.items()}
        if method == "digests":
            return {n: _digest(t) for n, t in model.received.items()}
        if method == "weights":
            return _fingerprints(model)
        if method == "set_names":
            model.set_names(*args)
            return None
        if method == "set_fail_on":
            model.fail_on = args[0]
            return None
        if method == "set_load_delay":
            model.load_delay_s = args[0]
            return None
        if method == "load_calls":
            return model.load_calls
        if method == "weight_version":
            return session.weight_version
        if method == "state_dict":
            return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        if method == "corrupt":
            corrupt_received(*args)
            return None
        if method in extra:
            return extra[method](*args, **kwargs)
        return getattr(session, method)(*args, **kwargs)

    def handle(conn: Connection) -> None:
        with conn:
            while True:
                try:
                    method, args, kwargs = conn.recv()
                except (EOFError, OSError):
                    return
                result: tuple[Any, ...]
                try:
                    with lock:
                        result = ("ok", local(method, args, kwargs))
                except BaseException as e:
                    result = ("err", f"{type(e).__name__}: {e}", traceback.format_exc())
                try:
                    conn.send(result)
                except (OSError, BrokenPipeError):
                    return

    with listener:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            if stopping.is_set():  # STOP's wake-up call
                conn.close()
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()


def corrupt_received(
    bucket: int | None, at: int = 0, mask: int = 0xFF, add: list[int] | None = None
) -> None:
    """Flip byte `at` (xor `mask`) of bucket `bucket` as this process receives it, or with
    `add`, add `add[i]` to the 32-bit word at byte `at + 4 i` (`at` a multiple of 4),
    (`seams.install_bucket_hook`); `None` removes it."""
    from weight_transfer.testing.seams import install_bucket_hook

    if bucket is None:
        install_bucket_hook(None)
        return

    def flip(k: int, buf: torch.Tensor) -> None:
        if k != bucket:
            return
        if add is None:
            buf[at] ^= mask
        else:
            words = buf[at : at + 4 * len(add)].view(torch.int32)
            words += torch.tensor(add, dtype=torch.int32, device=buf.device)

    install_bucket_hook(flip)


def _digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()}"


def digest(t: torch.Tensor) -> str:
    """Bit-exact fingerprint of a tensor: dtype, shape and a hash of its bytes."""
    return _digest(t)


class FanoutClient:
    """Calls every worker, blocks on all; raises `WeightSyncRPCError` naming the worker.

    The first error raises at once (a worker that refused, or is gone), naming the
    worker; a worker that cannot be reached raises its `ConnectionError` after every
    other worker got the call. As in a vLLM engine, which runs one call at a time,
    a worker runs this client's calls in order: a call that raised before every
    worker answered leaves those answers owed, and the next call waits for them
    (within `timeout_s`) before it goes out, so it never runs beside the one before
    it (an abort one worker refused, "no round", has run on the others before the
    next start).
    """

    def __init__(self, addresses: list[Any], timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.addresses = addresses
        self.timeout_s = timeout_s
        self._conns: list[Connection | None] = [None] * len(addresses)
        self._owed: set[int] = set()  # workers still running a call that raised

    def __getstate__(self) -> dict[str, Any]:
        return {"addresses": self.addresses, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.addresses, self.timeout_s = state["addresses"], state["timeout_s"]
        self._conns, self._owed = [None] * len(self.addresses), set()

    def _connect(self) -> dict[int, OSError]:
        """Connect to every worker not connected; the workers unreachable, by index."""
        unreachable: dict[int, OSError] = {}
        for i, c in enumerate(self._conns):
            if c is None:
                try:
                    self._conns[i] = Client(self.addresses[i], authkey=AUTHKEY)
                except OSError as e:
                    unreachable[i] = e
        return unreachable

    def _drop(self, i: int) -> None:
        c, self._conns[i] = self._conns[i], None
        self._owed.discard(i)
        if c is not None:
            c.close()

    def _settle(self, method: str, deadline: float) -> None:
        """Receive (and discard) the answers an earlier call left owed, before `method`."""
        while self._owed:
            for i in sorted(self._owed):
                c = self._conns[i]
                try:
                    if c is None or c.poll(0.01):
                        if c is not None:
                            c.recv()
                        self._owed.discard(i)
                except (EOFError, OSError):
                    self._drop(i)  # gone: the next call reconnects (and fails if it is)
            if self._owed and time.monotonic() > deadline:
                from weight_transfer.clients import WeightSyncRPCError

                owed = sorted(self._owed)
                for i in owed:
                    self._drop(i)
                raise WeightSyncRPCError(
                    method,
                    f"workers {owed} did not finish the call before it within {self.timeout_s:g}s",
                )

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        from weight_transfer.clients import WeightSyncRPCError

        deadline = time.monotonic() + self.timeout_s
        self._settle(method, deadline)
        unreachable = self._connect()
        conns = [c for c in self._conns if c is not None]
        for c in conns:
            c.send((method, args, kwargs))
        if unreachable:  # the others run the call (an abort reaches the survivors at once)
            self._owed = {j for j, c in enumerate(self._conns) if c is not None}
            raise next(iter(unreachable.values()))  # (a ConnectionError, as before)
        results: list[Any] = [None] * len(conns)
        pending = set(range(len(conns)))
        while pending:
            for i in sorted(pending):
                c = conns[i]
                try:
                    if not c.poll(0.01):
                        continue
                    reply = c.recv()
                except (EOFError, OSError) as e:
                    self._drop(i)
                    self._owed = pending - {i}
                    raise WeightSyncRPCError(method, f"worker {i} is gone ({e})") from e
                pending.discard(i)
                if reply[0] == "err":
                    self._owed = set(pending)
                    raise WeightSyncRPCError(method, f"worker {i}: {reply[1]}")
                results[i] = reply[1]
            if pending and time.monotonic() > deadline:
                for i in pending:
                    self._drop(i)
                raise WeightSyncRPCError(
                    method, f"workers {sorted(pending)} gave no answer within {self.timeout_s:g}s"
                )
        return results

    # the VLLMWeightSyncClient protocol
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)


def assert_received(pool: WorkerPool, tensors: dict[str, torch.Tensor]) -> None:
    """Every worker of `pool` received exactly `tensors` (bit for bit)."""
    want = {n: digest(t) for n, t in tensors.items()}
    for rank, got in enumerate(pool.each("digests")):
        for name in want:
            assert got.get(name) == want[name], f"worker {rank}: {name} differs"


class RecordingClient:
    """Forwards to `inner`; keeps every handshake and update payload (a round's
    seal, which carries no weights, apart in `seals`), and runs `on_init(payload)`
    before forwarding a handshake."""

    def __init__(self, inner: Any, on_init: Any = None) -> None:
        self.inner = inner
        self.on_init = on_init
        self.payloads: list[Any] = []
        self.seals: list[Any] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.payloads.append(init_info)
        if self.on_init is not None:
            self.on_init(init_info)
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        sealing = isinstance(update_info, dict) and SEAL_FIELD in update_info
        (self.seals if sealing else self.payloads).append(update_info)
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


class ForbiddenClient:
    """The client of a non-sender trainer rank, which must never reach the inference side."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"non-sender rank called client.{name}")


class WorkerPool:
    """`n` worker processes of `backend`; use as a context manager (stops them by PID).

    With `in_process`, each worker is a thread of this process serving the same
    calls (for a backend whose transport reaches only its own process); such a
    worker cannot be killed, and `stop` shuts its engine down.
    """

    def __init__(
        self,
        backend: str,
        n: int,
        *,
        names: list[str] | None = None,
        fail_on: str | None = None,
        load_delay_s: float = 0.0,
        start_timeout_s: float = 120.0,
        model_factory: str | None = None,
        devices: list[str] | None = None,
        sys_path: list[str] | None = None,
        handlers: str | None = None,
        in_process: bool = False,
    ) -> None:
        self.start_timeout_s = start_timeout_s
        self.in_process = in_process
        self.specs = [
            WorkerSpec(
                backend,
                rank,
                n,
                names,
                fail_on,
                load_delay_s,
                model_factory=model_factory,
                device=devices[rank] if devices else "cpu",
                sys_path=list(sys_path or []),
                handlers=handlers,
            )
            for rank in range(n)
        ]
        started = [self._spawn(spec) for spec in self.specs]
        self.processes: list[Any] = [process for process, _ in started]
        self.addresses: list[Any] = []
        for rank, (_, parent) in enumerate(started):
            self.addresses.append(self._address(rank, parent))

    def _spawn(self, spec: WorkerSpec) -> tuple[Any, Any]:
        if self.in_process:
            parent, child = mp.Pipe()
            thread = threading.Thread(
                target=_serve, args=(spec, child), name=f"wt-worker-{spec.rank}", daemon=True
            )
            thread.start()
            return thread, parent
        ctx = worker_context()
        parent, child = ctx.Pipe()
        spec = dataclasses.replace(spec, env={**os.environ, **spec.env})
        process = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        process.start()
        return process, parent

    def _address(self, rank: int, parent: Any) -> Any:
        if not parent.poll(self.start_timeout_s):
            self.stop()
            raise TimeoutError(f"worker {rank} did not start within {self.start_timeout_s}s")
        status, payload = parent.recv()
        if status != "ok":
            self.stop()
            raise RuntimeError(f"worker {rank} failed to start: {payload}")
        return payload

    def restart(self, i: int) -> None:
        """Kill worker `i` and start a fresh one in its place (a fresh engine, never
        connected): the pool's clients reach it at their next call."""
        self.kill(i)
        self.processes[i], parent = self._spawn(self.specs[i])
        self.addresses[i] = self._address(i, parent)

    def client(self, timeout_s: float = CALL_TIMEOUT_S) -> FanoutClient:
        return FanoutClient(self.addresses, timeout_s)

    def each(self, method: str, *args: Any) -> list[Any]:
        """Call a harness method (`received`, `digests`, ...) on every worker."""
        return FanoutClient(self.addresses).call(method, *args)

    def on(self, i: int, method: str, *args: Any) -> Any:
        """Call a harness or session method on worker `i` only."""
        return FanoutClient([self.addresses[i]]).call(method, *args)[0]

    def kill(self, i: int) -> None:
        if self.in_process:
            raise RuntimeError("a worker of an in-process pool is a thread: it cannot be killed")
        p = self.processes[i]
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, 9)
            p.join(10)

    def stop(self) -> None:
        for i, p in enumerate(self.processes):
            if self.in_process:
                with contextlib.suppress(Exception):  # it may never have started serving
                    self.on(i, STOP)
            elif p.is_alive():
                p.kill()
            p.join(10)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
