"""Which carrier moves a sync's bytes: `loopback` (in process) or `nixl` (Ray)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wt_sharded_rdt.producer import Producer
from wt_sharded_rdt.transport import LoopbackClient, LoopbackHost, ProducerClient, ProducerHost

__all__ = ["host_producer", "producer_client", "ray_location"]


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
    from wt_sharded_rdt.nixl import RayHost

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

    from wt_sharded_rdt.nixl import RayClient

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
