"""The project's worker harness: `weight_transfer.testing.workers`, with host-sync counting.

`WorkerPool` here serves two more methods in every worker: `count_host_syncs`
starts counting host syncs on every thread, `host_syncs` stops and returns
the counts per method (`wt_tools.counting.HostSyncs`).
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
]


def host_sync_handlers(model: Any, session: Any) -> dict[str, Any]:
    from wt_tools.counting import HostSyncs

    counters: list[HostSyncs] = []

    def count_host_syncs() -> None:
        counters.append(HostSyncs().start())

    def host_syncs() -> dict[str, int]:
        return dict(counters.pop().stop().counts)

    return {"count_host_syncs": count_host_syncs, "host_syncs": host_syncs}


class WorkerPool(_WorkerPool):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("handlers", "tests.harness:host_sync_handlers")
        super().__init__(*args, **kwargs)
