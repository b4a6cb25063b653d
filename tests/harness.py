"""The project's worker harness: `weight_transfer.testing.workers`, with cost counting.

`WorkerPool` here serves two more methods in every worker, `count_costs` and
`costs` (`wt_tools.costs.worker_counters`): host reads and wire messages on
every thread, and the aten ops of the worker's unpacking.
"""

from __future__ import annotations

from typing import Any

from weight_transfer.testing.workers import (
    CALL_TIMEOUT_S,
    FanoutClient,
    ForbiddenClient,
    RecordingClient,
    RecordingModel,
    WorkerSpec,
    _serve,
    assert_received,
    corrupt_received,
    digest,
    worker_context,
)
from weight_transfer.testing.workers import WorkerPool as _WorkerPool

__all__ = [
    "CALL_TIMEOUT_S",
    "FanoutClient",
    "ForbiddenClient",
    "RecordingClient",
    "RecordingModel",
    "WorkerPool",
    "WorkerSpec",
    "_serve",
    "assert_received",
    "corrupt_received",
    "digest",
    "worker_context",
    "weights",
    "nccl_trainer",
    "ipc_trainer",
]


def cost_handlers(model: Any, session: Any) -> dict[str, Any]:
    from wt_tools.costs import worker_counters

    return worker_counters()


def weights(pool: _WorkerPool) -> list[dict[str, str]]:
    """Each worker's parameters, as digests by name."""
    return [{n: digest(t) for n, t in sd.items()} for sd in pool.each("state_dict")]


def nccl_trainer(pool: _WorkerPool, source: Any, client: Any = None, **wire: Any) -> Any:
    """A wt_nccl trainer (rank 0) connected to every worker of `pool` over a fresh port."""
    from wt_kits.group.stateless import free_port
    from wt_nccl import NCCLTrainerInitInfo

    wire.setdefault("timeout_s", 30.0)
    world = 1 + len(pool.processes)
    info = NCCLTrainerInitInfo("127.0.0.1", free_port(), world, rank=0, **wire)
    return _trainer_init(info, client or pool.client(), source)


def ipc_trainer(pool: _WorkerPool, source: Any, client: Any = None, **wire: Any) -> Any:
    """A wt_ipc trainer (rank 0) attached to every worker of `pool`."""
    from wt_ipc import IPCTrainerInitInfo

    wire.setdefault("timeout_s", 30.0)
    wire.setdefault("num_workers", len(pool.processes))
    info = IPCTrainerInitInfo(rank=0, **wire)
    return _trainer_init(info, client or pool.client(), source)


def _trainer_init(info: Any, client: Any, source: Any) -> Any:
    from weight_transfer import WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class WorkerPool(_WorkerPool):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("handlers", "tests.harness:cost_handlers")
        super().__init__(*args, **kwargs)
