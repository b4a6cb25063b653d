"""Which inference worker this is, among how many.

Engines read their position through `worker_position(vllm_config)` only, so
they work the same inside vLLM (a `VllmConfig`), embedded in another worker (a
`WorkerPosition`) or as the only worker (`None`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerPosition", "worker_position", "is_vllm_config"]


@dataclass(frozen=True)
class WorkerPosition:
    """A worker's place: `rank` within its replica of `world_size` (TP x PP)
    workers, and the replica's `data_parallel_index` among `data_parallel_size`."""

    rank: int = 0
    world_size: int = 1
    data_parallel_index: int = 0
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")
        if not 0 <= self.data_parallel_index < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_index {self.data_parallel_index} is outside "
                f"[0, {self.data_parallel_size})"
            )

    @property
    def global_index(self) -> int:
        """This worker's index among all workers of all replicas."""
        return self.data_parallel_index * self.world_size + self.rank

    @property
    def total_workers(self) -> int:
        return self.world_size * self.data_parallel_size


def worker_position(vllm_config: Any) -> WorkerPosition:
    """The position described by `vllm_config`: a `VllmConfig`, a `WorkerPosition` or None."""
    if vllm_config is None:
        return WorkerPosition()
    if isinstance(vllm_config, WorkerPosition):
        return vllm_config
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        raise TypeError(
            "vllm_config must be a VllmConfig, a weight_transfer.WorkerPosition or None; "
            f"got {type(vllm_config).__name__}"
        )
    dp_index = getattr(pc, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(pc, "data_parallel_rank", None) or 0
    return WorkerPosition(
        rank=int(pc.rank),
        world_size=int(pc.world_size),
        data_parallel_index=int(dp_index),
        data_parallel_size=int(getattr(pc, "data_parallel_size", 1)),
    )


def is_vllm_config(vllm_config: Any) -> bool:
    """Whether `vllm_config` is a `vllm.config.VllmConfig`: the worker runs inside vLLM
    (never imports vllm)."""
    config_module = sys.modules.get("vllm.config")
    vllm_config_cls = getattr(config_module, "VllmConfig", None)
    return vllm_config_cls is not None and isinstance(vllm_config, vllm_config_cls)
