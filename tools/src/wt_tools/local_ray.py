"""A Ray cluster of this machine only, for the backends whose transport runs on Ray.

`local_ray(temp_dir)` (a context manager) starts Ray on 127.0.0.1 with its
files under `temp_dir` and UCX restricted to loopback TCP and shared memory
(what NIXL needs on a machine without RDMA), checks that every node listens
on loopback only, and shuts down that cluster, and only it, on exit. Its
workers run at this process's niceness, not at Ray's default of 15: an actor
(an engine, a producer) then competes for the cores on equal terms with the
processes that wait on it (at 15, on two cores kept busy at niceness 0, an
actor's call needing 20 ms of CPU took 1.3 s).
`start_local_ray` does the same until the process exits. Both refuse to run
when this process is already connected to a cluster.

`set_loopback_env()` must run before anything imports Ray (vLLM does):
Ray picks the machine's external address otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["local_ray", "start_local_ray", "set_loopback_env", "LOOPBACK_ENV"]

LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_TLS": "tcp,sm,self",
    "UCX_NET_DEVICES": "lo",
}


def set_loopback_env() -> None:
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def _start(temp_dir: str, num_cpus: int, env: Mapping[str, str]) -> Any:
    set_loopback_env()
    import ray

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    os.makedirs(temp_dir, exist_ok=True)
    ray.init(
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        log_to_driver=False,
        runtime_env={"env_vars": {**{k: os.environ[k] for k in LOOPBACK_ENV}, **env}},
        _system_config={"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)},
    )
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        ray.shutdown()
        raise RuntimeError(f"Ray is not on loopback only: {sorted(addresses)}")
    return ray


@contextlib.contextmanager
def local_ray(
    temp_dir: str, num_cpus: int = 2, env: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """The `ray` module, connected to a new loopback cluster; `env` reaches every worker."""
    ray = _start(temp_dir, num_cpus, env or {})
    try:
        yield ray
    finally:
        ray.shutdown()


def start_local_ray(scratch: str, num_cpus: int = 2) -> str:
    """Start a loopback cluster (files under `scratch/ray`) until exit; returns its address."""
    ray = _start(os.path.join(scratch, "ray"), num_cpus, {})
    atexit.register(ray.shutdown)
    return str(ray.get_runtime_context().gcs_address)
