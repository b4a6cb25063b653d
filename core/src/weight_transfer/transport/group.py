"""A private process group between trainer rank 0 and the inference workers.

`StatelessGroup.create(...)` rendezvouses through its own `TCPStore` (rank 0
listens) and builds a gloo group for CPU tensors or an NCCL group for CUDA
tensors. It never reads or changes `torch.distributed`'s default group, so it
coexists with the trainer's FSDP/TP groups and with vLLM's own groups.

Every wait is bounded by `timeout_s`: the store connection, the rendezvous
and each collective. A collective that fails or times out leaves the group
unusable; `abort()` it and build a new one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StatelessGroup", "free_port"]


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


@dataclass
class StatelessGroup:
    """A rank's membership in a private group; `rank` 0 is the trainer sender."""

    rank: int
    world_size: int
    device: torch.device
    store: dist.Store
    pg: Any
    timeout_s: float

    @classmethod
    def create(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        name: str = "wt",
    ) -> StatelessGroup:
        """Join (rank 0: host) group `name` at `host:port`; blocks at most `timeout_s`.

        `device` picks the library: gloo for CPU, NCCL for CUDA. Raises
        `ValueError` for a rank outside `[0, world_size)` and the store's or
        group's own error (naming the address) when the rendezvous fails.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        except Exception as e:
            role = "listen on" if rank == 0 else "reach the trainer's store at"
            raise RuntimeError(f"rank {rank} could not {role} {host}:{port}: {e}") from e
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
        return cls(rank, world_size, device, store, pg, timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting `tensor` from `src`; returns the pending work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def abort(self) -> None:
        """Drop the group without waiting for collectives in flight."""
        with contextlib.suppress(Exception):  # the group is being discarded either way
            self.pg.abort()

    def close(self) -> None:
        """Release the group after a clean run."""
        with contextlib.suppress(Exception):
            self.pg.shutdown()
