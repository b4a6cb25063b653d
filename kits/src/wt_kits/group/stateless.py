"""A private process group between trainer rank 0 and the inference workers.

`StatelessGroup.create(...)` rendezvouses through its own authenticated store
(`kits/group/store.py`: rank 0 listens on exactly the address given and admits
only workers that prove the group's `secret`) and builds a gloo group for CPU
tensors or an NCCL group for CUDA tensors. It never reads or changes
`torch.distributed`'s default group, so it coexists with the trainer's FSDP/TP
groups and with vLLM's own groups.

Every wait is bounded by `timeout_s`: the store connection (also against a
peer that accepts and never answers), the rendezvous and each collective; a
worker waiting in a collective (`wait`) also notices a dead trainer within
about a second. A collective that fails or times out leaves the group
unusable; `abort()` it and build a new one.

Aborting never blocks the caller. gloo cannot cancel a collective in flight,
and destroying its process group waits for every one of them to end (at most
`timeout_s`, holding the interpreter lock: the whole process would stall). So
`abort()` hands the process group and its collectives in flight to a daemon
thread (`_bury`), which drops them once those have ended; a process that
exits first never destroys them, so its exit does not wait either.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weight_transfer.runtime.waiting import CollectiveError, TransferTimeout, wait_work
from wt_kits.group.auth import check_secret
from wt_kits.group.store import (
    HANDSHAKE_TIMEOUT_S,
    RemoteStore,
    StoreServer,
    connect_store,
)

__all__ = ["StatelessGroup", "Hosting", "free_port", "LIVENESS_PERIOD_S"]

# How often a worker waiting in a collective checks that the trainer is alive.
LIVENESS_PERIOD_S = 0.5
# Set by rank 0 while its side of the group is open; deleted when it closes or aborts.
_OPEN_KEY = "wt/trainer-open"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, chosen at random below the
    kernel's ephemeral range: a port from that range (what binding port 0 gives)
    can be handed to any process's outgoing connection before its caller binds it."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(_PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in [{_PORTS_FROM}, {low}) after 200 tries")


_PORTS_FROM = 10000  # above the well-known and most registered services' ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _PORTS_FROM + 1000 else 32768


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _open_store(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    secret: str,
    trainer_id: str,
    hosting: Hosting | None,
) -> tuple[dist.Store, StoreServer | None]:
    """Rank 0: the listening `StoreServer` (handed to `hosting`) and its own store; a
    worker: its admitted connection. Raises `RuntimeError` (or `StoreRefused`)
    naming the address."""
    if rank != 0:
        store = connect_store(
            host, port, secret=secret, trainer_id=trainer_id, rank=rank, timeout_s=timeout_s
        )
        return store, None
    try:
        server = StoreServer(
            host,
            port,
            secret=secret,
            trainer_id=trainer_id,
            world_size=world_size,
            handshake_timeout_s=min(HANDSHAKE_TIMEOUT_S, timeout_s),
        )
    except OSError as e:
        raise RuntimeError(f"rank 0 could not listen on {host}:{port}: {e}") from e
    server.store.set_timeout(timedelta(seconds=timeout_s))
    if hosting is not None:
        hosting.listening(server)
    return server.store, server


class Hosting:
    """A handle on rank 0's rendezvous while it runs on another thread (`create(hosting=)`).

    `cancel()` closes rank 0's store, so the group's construction, which waits
    in that store for the workers, fails at once instead of at its timeout: a
    failed init must not leave a thread blocked inside the library (a process
    that exits while one is aborts).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: StoreServer | None = None
        self._cancelled = False

    def listening(self, server: StoreServer) -> None:
        with self._lock:
            self._server = server
            if self._cancelled:
                server.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._server is not None:
                self._server.close()


def _process_group(
    store: dist.Store,
    name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: timedelta,
    host: str,
    port: int,
) -> Any:
    """The gloo (CPU) or NCCL (CUDA) group over `store`; rank 0 first marks its end open."""
    timeout_s = timeout.total_seconds()
    if rank == 0:
        store.set(_OPEN_KEY, "1")
    prefixed = dist.PrefixStore(name, store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_opts._timeout = timeout
        iface = (
            dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
            if _is_loopback(host)
            else dist.ProcessGroupGloo.create_default_device()
        )
        gloo_opts._devices = [iface]
        try:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, gloo_opts)
        except Exception as e:
            raise RuntimeError(
                f"rank {rank} of {world_size} failed to join group {name!r} at "
                f"{host}:{port} within {timeout_s:g}s: {e}"
            ) from e
    return pg


@dataclass
class StatelessGroup:
    """A rank's membership in a private group; `rank` 0 is the trainer sender."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    pg: Any
    timeout_s: float
    server: StoreServer | None = None
    _inflight: list[dist.Work] = field(default_factory=list, repr=False)

    @classmethod
    def create(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        secret: str,
        trainer_id: str = "",
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        name: str = "wt",
        hosting: Hosting | None = None,
    ) -> StatelessGroup:
        """Join (rank 0: host) group `name` at `host:port`; blocks at most `timeout_s`.

        `hosting` (rank 0) receives the listening server, so that another thread
        can cancel the rendezvous (`Hosting.cancel`).

        Rank 0 listens on exactly `host:port` and admits each worker rank once,
        after it proved `secret` for `trainer_id` (and proved it back); a worker
        joins only a rank 0 that does. `device` picks the library: gloo for
        CPU, NCCL for CUDA. Raises `ValueError` for a rank outside
        `[0, world_size)` or an unusable `secret` (naming the field),
        `StoreRefused` naming the address when a worker refuses the process
        there or is refused by it, and the store's or group's own error
        (naming the address) when the rendezvous fails.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        check_secret(secret, what="StatelessGroup.create")
        device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store, server = _open_store(
            host, port, rank, world_size, timeout_s, secret, trainer_id, hosting
        )
        try:
            pg = _process_group(store, name, rank, world_size, device, timeout, host, port)
        except BaseException:
            _close_store(store, server)
            raise
        return cls(rank, world_size, device, store, pg, timeout_s, server)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting `tensor` from `src`; returns the pending work."""
        if self.pg is None:
            raise CollectiveError("the group was aborted; build a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        work = self.pg.broadcast([tensor], opts)
        self._inflight = [w for w in self._inflight if not w.is_completed()]
        self._inflight.append(work)
        return work

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for a collective's `work`, at most `timeout_s`.

        On a worker rank the trainer's liveness is probed every
        `LIVENESS_PERIOD_S` while waiting (`trainer_alive`), so a trainer that
        died or dropped its end mid-round is noticed within about a second
        instead of at the timeout. Raises `CollectiveError`
        naming `what` when the collective fails or the trainer is gone, and
        `TransferTimeout` when the time runs out.
        """

        def check_trainer() -> None:
            if not self.trainer_alive():
                raise CollectiveError(
                    f"{what} failed: the trainer left the group (it died, or closed its end)"
                )

        deadline = time.monotonic() + self.timeout_s
        try:
            wait_work(
                work,
                what,
                deadline,
                check=check_trainer if self.rank != 0 else None,
                check_every_s=LIVENESS_PERIOD_S,
            )
        except TransferTimeout:
            raise TransferTimeout(f"{what} did not complete within {self.timeout_s:g}s") from None

    def trainer_alive(self) -> bool:
        """Whether rank 0 still has its end open: its store answers and says so."""
        try:
            return bool(self.store.check([_OPEN_KEY]))
        except Exception:
            return False

    def _leave(self) -> None:
        if self.rank == 0:  # tell the workers at once, whoever still holds this object
            with contextlib.suppress(Exception):
                self.store.delete_key(_OPEN_KEY)

    def abort(self) -> None:
        """Drop the group without waiting for collectives in flight (see the module
        doc); rank 0 stops listening at once (the port can be bound again)."""
        self._leave()
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # the group is being discarded either way
                pg.abort()
            inflight, self._inflight = self._inflight, []
            _bury(pg, inflight, self.timeout_s)
        _close_store(self.store, self.server)

    def close(self) -> None:
        """Release the group after a clean run; rank 0 stops listening at once."""
        self._leave()
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()
            inflight, self._inflight = self._inflight, []
            _bury(pg, inflight, self.timeout_s)  # a clean run has none in flight: at once
        _close_store(self.store, self.server)


_BURY_POLL_S = 0.2


def _bury(pg: Any, inflight: list[dist.Work], timeout_s: float) -> None:
    """Drop `pg` on a daemon thread once `inflight` has ended (at most `timeout_s`
    and a margin: gloo fails each collective by its own timeout)."""

    def wait_then_drop(held: list[Any]) -> None:
        deadline = time.monotonic() + timeout_s + 5.0
        while time.monotonic() < deadline and not all(w.is_completed() for w in held[1:]):
            time.sleep(_BURY_POLL_S)
        held.clear()  # the last references: the group is destroyed here, at once

    threading.Thread(
        target=wait_then_drop, args=([pg, *inflight],), name="wt-group-reaper", daemon=True
    ).start()


def _close_store(store: dist.Store, server: StoreServer | None) -> None:
    """Close rank 0's server (listening socket and connections) or a worker's connection."""
    if server is not None:
        server.close()
    if isinstance(store, RemoteStore):
        store.close()
