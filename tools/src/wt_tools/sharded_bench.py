"""What `sharded_rdt` moves to each worker of a tensor-parallel engine.

A broadcast backend sends every byte of the model to every worker; with
`sharded_rdt` each worker pulls only the slices its loaders keep. `measure`
builds a Megatron-style MLP stack (`ShardedMLP`: column-parallel up
projection, row-parallel down projection, replicated norms; loaders that
narrow the checkpoint tensor by rank, as vLLM's do), shards it `tp` ways,
syncs it from one trainer over the loopback transport (the bytes a worker
pulls do not depend on the transport) and reports per worker the bytes
pulled, against the whole model. Each sync is checked: every worker's
parameters equal a fresh shard loaded from the same tensors.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable
from typing import Any, cast

import torch

from wt_tools.scenarios import TensorSource

__all__ = ["ShardedMLP", "measure"]


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, rank: int, tp: int) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        self.norm = torch.nn.Parameter(torch.zeros(hidden))
        self.up = torch.nn.Parameter(torch.zeros(inter // tp, hidden))
        self.down = torch.nn.Parameter(torch.zeros(hidden, inter // tp))


class ShardedMLP(torch.nn.Module):
    """Shard `rank` of `tp` of an MLP stack; `load_weights` takes checkpoint tensors."""

    def __init__(self, layers: int, hidden: int, rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        inter = 4 * hidden
        self.blocks = torch.nn.ModuleList(_Block(hidden, inter, rank, tp) for _ in range(layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            _, i, kind = name.split(".")
            block = cast(_Block, self.blocks[int(i)])
            if kind == "norm":
                block.norm.data.copy_(w)
            elif kind == "up":
                rows = block.up.shape[0]
                block.up.data.copy_(w.narrow(0, block.rank * rows, rows))
            else:
                cols = block.down.shape[1]
                block.down.data.copy_(w.narrow(1, block.rank * cols, cols))


def checkpoint(layers: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        out[f"blocks.{i}.norm"] = torch.randn(hidden, generator=g)
        out[f"blocks.{i}.up"] = torch.randn(4 * hidden, hidden, generator=g)
        out[f"blocks.{i}.down"] = torch.randn(hidden, 4 * hidden, generator=g)
    return out


class _Workers:
    """One engine's workers: each call goes to all at once."""

    def __init__(self, sessions: list[Any]) -> None:
        self.sessions = sessions
        self.pool = concurrent.futures.ThreadPoolExecutor(len(sessions))

    def _all(self, method: str, *args: Any) -> None:
        for future in [self.pool.submit(getattr(s, method), *args) for s in self.sessions]:
            future.result(600)

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, info: Any) -> None:
        self._all("update_weights", info)

    def finish_weight_update(self, version: str | None = None) -> None:
        self._all("finish_weight_update", version)


def measure(tp: int, layers: int = 8, hidden: int = 1024, repeats: int = 3) -> dict[str, Any]:
    """Sync a `tp`-way sharded engine `repeats` times; bytes per worker and seconds."""
    from weight_transfer import WorkerPosition, WorkerSession
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo
    from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

    models = [ShardedMLP(layers, hidden, r, tp) for r in range(tp)]
    engines = [
        ShardedRDTWorkerEngine(None, WorkerPosition(r, tp), "cpu", m) for r, m in enumerate(models)
    ]
    targets = [checkpoint(layers, hidden, seed) for seed in (1, 2)]
    source = TensorSource(targets[0])
    info = ShardedRDTTrainerInitInfo(
        rank=0, num_consumers=tp, transport="loopback", producer_prefix=f"wt-bench-tp{tp}"
    )
    trainer = ShardedRDTTrainerEngine.trainer_init(
        info,
        client=_Workers([WorkerSession(e) for e in engines]),
        source=source,
    )
    seconds = []
    try:
        for r in range(repeats):
            source.tensors = targets[r % 2]
            t0 = time.perf_counter()
            trainer.send_weights()
            seconds.append(time.perf_counter() - t0)
            for rank, model in enumerate(models):
                fresh = ShardedMLP(layers, hidden, rank, tp)
                fresh.load_weights(source.tensors.items())
                for (name, got), want in zip(
                    model.state_dict().items(), fresh.state_dict().values(), strict=True
                ):
                    if not torch.equal(got, want):
                        raise AssertionError(f"tp={tp} worker {rank}: {name} differs")
    finally:
        trainer.shutdown()
        for engine in engines:
            engine.shutdown()
    total = sum(t.numel() * t.element_size() for t in targets[0].values())
    return {
        "tp": tp,
        "model_bytes": total,
        "bytes_per_worker": [e.pulled_bytes for e in engines],
        "seconds": sorted(seconds)[len(seconds) // 2],
    }
