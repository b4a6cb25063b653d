"""A private process group between trainer rank 0 and the inference workers.

`StatelessGroup.create(...)` rendezvouses through its own authenticated store
(`transport/store.py`: rank 0 listens on exactly the address given and admits
only workers that prove the group's `secret`) and builds a gloo group for CPU
tensors or an NCCL group for CUDA tensors. It never reads or changes
`torch.distributed`'s default group, so it coexists with the trainer's FSDP/TP
groups and with vLLM's own groups.

Every wait is bounded by `timeout_s`: the store connection (also against a
peer that accepts and never answers), the rendezvous and each collective; a
worker waiting in a collective (`wait`) also notices a dead trainer within
about a second. A collective that fails or times out leaves the group
unusable; `abort()` it and build a new one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weight_transfer.transport.auth import check_secret
from weight_transfer.transport.futures import CollectiveError, TransferTimeout
from weight_transfer.transport.store import (
    HANDSHAKE_TIMEOUT_S,
    RemoteStore,
    StoreServer,
    connect_store,
)

__all__ = ["StatelessGroup", "free_port", "LIVENESS_PERIOD_S"]

# How often a worker waiting in a collective checks that the trainer is alive.
LIVENESS_PERIOD_S = 0.5
# Set by rank 0 while its side of the group is open; deleted when it closes or aborts.
_OPEN_KEY = "wt/trainer-open"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _open_store(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, secret: str, trainer_id: str
) -> tuple[dist.Store, StoreServer | None]:
    """Rank 0: the listening `StoreServer` and its own store; a worker: its admitted
    connection. Raises `RuntimeError` (or `StoreRefused`) naming the address."""
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
    return server.store, server


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
    ) -> StatelessGroup:
        """Join (rank 0: host) group `name` at `host:port`; blocks at most `timeout_s`.

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
        store, server = _open_store(host, port, rank, world_size, timeout_s, secret, trainer_id)
        try:
            pg = _process_group(store, name, rank, world_size, device, timeout, host, port)
        except BaseException:
            _close_store(store, server)
            raise
        return cls(rank, world_size, device, store, pg, timeout_s, server)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting `tensor` from `src`; returns the pending work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for a collective's `work`, at most `timeout_s`.

        On a worker rank the trainer's liveness is probed every
        `LIVENESS_PERIOD_S` while waiting (`trainer_alive`), so a trainer that
        died or dropped its end mid-round is noticed within about a second
        instead of at the timeout. Raises `CollectiveError`
        naming `what` when the collective fails or the trainer is gone, and
        `TransferTimeout` when the time runs out.
        """
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(min(LIVENESS_PERIOD_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{what} did not complete within {self.timeout_s:g}s")
            if self.rank != 0 and not self.trainer_alive():
                raise CollectiveError(
                    f"{what} failed: the trainer left the group (it died, or closed its end)"
                )
        try:
            work.wait()
        except Exception as e:
            raise CollectiveError(
                f"{what} failed (a peer process died, the network broke or it timed out): {e}"
            ) from e

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
        """Drop the group without waiting for collectives in flight; rank 0 stops
        listening at once (the port can be bound again)."""
        self._leave()
        with contextlib.suppress(Exception):  # the group is being discarded either way
            self.pg.abort()
        _close_store(self.store, self.server)

    def close(self) -> None:
        """Release the group after a clean run; rank 0 stops listening at once."""
        self._leave()
        with contextlib.suppress(Exception):
            self.pg.shutdown()
        _close_store(self.store, self.server)


def _close_store(store: dist.Store, server: StoreServer | None) -> None:
    """Close rank 0's server (listening socket and connections) or a worker's connection."""
    if server is not None:
        server.close()
    if isinstance(store, RemoteStore):
        store.close()
