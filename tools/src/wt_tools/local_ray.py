"""A Ray cluster of this machine only, for the backends whose transport runs on Ray.

`start_local_ray(scratch)` starts Ray on 127.0.0.1 with its files under
`scratch`, UCX restricted to loopback TCP and shared memory (what NIXL needs
on a machine without RDMA), and registers its shutdown at exit. It refuses to
run when this process is already connected to a cluster, and checks that
every node listens on loopback only.
"""

from __future__ import annotations

import atexit
import os

__all__ = ["start_local_ray", "LOOPBACK_ENV"]

LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_TLS": "tcp,sm,self",
    "UCX_NET_DEVICES": "lo",
}


def start_local_ray(scratch: str, num_cpus: int = 2) -> str:
    """Start the cluster (see the module docstring); returns its address."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    temp_dir = os.path.join(scratch, "ray")
    os.makedirs(temp_dir, exist_ok=True)
    ray.init(
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        log_to_driver=False,
        runtime_env={"env_vars": {k: os.environ[k] for k in LOOPBACK_ENV}},
    )
    atexit.register(ray.shutdown)
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        ray.shutdown()
        raise RuntimeError(f"Ray is not on loopback only: {sorted(addresses)}")
    return str(ray.get_runtime_context().gcs_address)
