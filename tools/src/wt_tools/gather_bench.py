"""What an FSDP2 trainer saves by sending local shards: the gathers it no longer runs.

`measure(ranks)` starts `ranks` processes in one gloo group, each holding an
MLP stack (`sharded_bench.ShardedMLP`'s checkpoint) whose every leaf module is
`fully_shard`ed on dim 0, and times, side by side in the same processes, one
pass of `ModuleSource.iter_full()` (every parameter gathered with
`full_tensor()`, what a backend sending full tensors runs on the trainer) and
one of `iter_local()` (each rank's own piece, what `sharded_rdt` with
`local_shards` runs), counting the collectives of each (`Collectives`).
Rank 0's medians are reported with the bytes each rank hands its producer.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

__all__ = ["measure"]


def measure(
    ranks: int = 2, layers: int = 8, hidden: int = 1024, repeats: int = 3
) -> dict[str, Any]:
    from wt_kits.group import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Pool(ranks) as pool:
        results = pool.starmap(
            _rank, [(r, ranks, port, layers, hidden, repeats) for r in range(ranks)]
        )
    return results[0]


def _rank(
    rank: int, ranks: int, port: int, layers: int, hidden: int, repeats: int
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weight_transfer import ModuleSource
    from wt_tools.counting import Collectives
    from wt_tools.sharded_bench import ShardedMLP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
    )
    try:
        model = ShardedMLP(layers, hidden)
        mesh = init_device_mesh("cpu", (ranks,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        source = ModuleSource(model)
        model_bytes = sum(m.nbytes for m in source.metadata())
        out: dict[str, Any] = {"ranks": ranks, "model_bytes": model_bytes, "params": 3 * layers}
        for how in ("iter_full", "iter_local"):
            times, published = [], 0
            for _ in range(repeats):
                dist.barrier()
                with Collectives() as counted:
                    start = time.perf_counter()
                    published = sum(t.numel() * t.element_size() for _, t in getattr(source, how)())
                    times.append(time.perf_counter() - start)
            out[how] = {
                "median_s": statistics.median(times),
                "gathers": counted.gathers,
                "bytes_per_rank": published,
            }
        out["saved_s"] = out["iter_full"]["median_s"] - out["iter_local"]["median_s"]
        return out
    finally:
        dist.destroy_process_group()


def table(result: dict[str, Any]) -> list[str]:
    """`measure`'s result as Markdown table lines."""
    rows = [
        "| trainer pass | s | all-gathers | MB handed to the producer per rank |",
        "| --- | --- | --- | --- |",
    ]
    for how, what in (("iter_full", "full tensors (gathered)"), ("iter_local", "local shards")):
        r = result[how]
        rows.append(
            f"| {what} | {r['median_s']:.4f} | {r['gathers']} | {r['bytes_per_rank'] / 1e6:.1f} |"
        )
    rows.append(
        f"| saved by local shards | {result['saved_s']:.4f} "
        f"({result['iter_full']['median_s'] / max(result['iter_local']['median_s'], 1e-9):.0f}x) "
        f"| | of {result['model_bytes'] / 1e6:.1f} MB over {result['ranks']} ranks |"
    )
    return rows
