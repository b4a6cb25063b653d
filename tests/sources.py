"""Weight sources for tests: explicit tensors, and sources that break the contract on purpose."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from weight_transfer.testing.models import DisagreeingSource, mixed_weights
from weight_transfer.testing.models import TensorSource as DictSource

__all__ = ["DictSource", "DisagreeingSource", "StallingSource", "dtensor_model", "mixed_tensors"]

mixed_tensors = mixed_weights  # the conformance suite's weights, by their older name


class StallingSource(DictSource):
    """Yields `stall_at` tensors, sets the event `stalled`, then hangs (a trainer stuck, or
    about to be killed, in the middle of a round)."""

    def __init__(self, tensors: dict[str, torch.Tensor], stall_at: int, stalled: Any) -> None:
        super().__init__(tensors)
        self.stall_at = stall_at
        self.stalled = stalled

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self.tensors.items()):
            if i == self.stall_at:
                self.stalled.set()
                time.sleep(600)
            yield pair


def dtensor_model(rank: int, group_port: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Join a 2-rank gloo default group as `rank`; a two-Linear model whose parameters
    are DTensors sharded on dim 0, and its full weights (the same on both ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for mod in model:
        for pname, p in list(mod.named_parameters()):
            setattr(mod, pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model, full
