"""The GPU benchmark: one prepared run against the device's copy ceiling, under 5 minutes.

    python -m wt_tools.gpu_bench [--gib 1] [--repeats 3] [--out bench-results/gpu.json]

On one CUDA device, for a dense float32 layout of `--gib` GiB (and a
MoE-like one of 30,000 tensors), medians of `--repeats` after a warm-up:

- ceiling: a device-to-device copy of the same bytes;
- packing: the trainer's packing of every tensor into device buckets
  (core's `Packer` over `checked_iteration`, as wt_nccl and wt_ipc do);
- wt_ipc: the trainer (this process) into a worker process on the same GPU
  through CUDA IPC (plain target, copies in place);
- wt_nccl: only with two GPUs (an NCCL group cannot hold two ranks of one
  device): the worker process on the second;
- for each of them, one more warm round counted as the CPU bench counts it
  (`wt_tools.costs`: control calls, wire messages, host reads on every
  thread, the trainer thread's aten ops, bytes copied and allocations, the
  worker's unpacking), plus the synchronizing CUDA calls torch's sync debug
  mode reports in this process;
- the digest of verified bytes (`wt_tools.digest_bench`) against a
  device-to-device copy of the same bucket.

Prints a table and writes JSON. Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main"]


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layout_case(name: str, layout: Any, repeats: int) -> dict[str, Any]:
    from weight_transfer.backend import checked_iteration
    from weight_transfer.factory import WeightTransferTrainerFactory
    from wt_kits.stream import Packer, RotatingBuffers, WireParams
    from wt_tools.counting import CountedClient
    from wt_tools.scenarios import TensorSource, _random_tensors
    from wt_tools.workers import WorkerProcesses, checksum

    tensors = {n: t.cuda() for n, t in _random_tensors(layout, 1).items()}
    source = TensorSource(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = list(tensors.values())
    copies = [torch.empty_like(t) for t in flat]
    metas = source.metadata()
    plan = WireParams().packed_plan(metas)
    buffers = RotatingBuffers(2, "cuda")

    def copy() -> None:
        for dst, src in zip(copies, flat, strict=True):
            dst.copy_(src)

    def pack() -> None:
        packer = Packer(plan, checked_iteration(metas, source), finite=True)
        for k in range(len(plan.buckets)):
            packer.pack(k, buffers)
        packer.exhaust()

    row: dict[str, Any] = {
        "case": name,
        "bytes": nbytes,
        "params": len(metas),
        "d2d_copy_s": _median(copy, repeats),
        "pack_s": _median(pack, repeats),
    }
    from wt_ipc import IPCTrainerInitInfo

    with WorkerProcesses(layout, 1, device="cuda:0") as workers:
        client = CountedClient(workers.client("ipc"))
        trainer: Any = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, device="cuda:0"), client=client, source=source
        )
        row["ipc_s"] = _median(trainer.send_weights, repeats)
        row["ipc_counts"] = _counted(trainer, client, workers, len(plan.buckets))
        if workers.call("checksum")[0] != checksum(flat):
            raise RuntimeError(f"{name}: wt_ipc delivered different bytes")
        trainer.shutdown()
    if torch.cuda.device_count() >= 2:
        from wt_kits.group.stateless import free_port
        from wt_nccl import NCCLTrainerInitInfo

        with WorkerProcesses(layout, 1, device="cuda:1") as workers:
            client = CountedClient(workers.client("nccl"))
            trainer = WeightTransferTrainerFactory.trainer_init(
                NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, device="cuda:0"),
                client=client,
                source=source,
            )
            row["nccl_s"] = _median(trainer.send_weights, repeats)
            row["nccl_counts"] = _counted(trainer, client, workers, len(plan.buckets))
            trainer.shutdown()
    for key in ("pack_s", "ipc_s", "nccl_s"):
        if key in row:
            row[key.replace("_s", "_x_copy")] = row[key] / row["d2d_copy_s"]
    return row


def _counted(trainer: Any, client: Any, workers: Any, buckets: int) -> dict[str, Any]:
    """One more warm round, counted (`wt_tools.costs`) on the trainer and in the
    worker, with the synchronizing CUDA calls torch itself reports in this process
    (`torch.cuda.set_sync_debug_mode("warn")`)."""
    import warnings

    from wt_tools.costs import count_round

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            counts = count_round(trainer.send_weights, client, workers)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts["buckets"] = buckets
    counts["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wt-gpu-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-results/gpu.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run")
        return 2
    from wt_tools.scenarios import dense_layout, moe_layout

    rows = [
        _layout_case(f"dense {args.gib:g} GiB", dense_layout(int(args.gib * 2**30)), args.repeats),
        _layout_case("MoE-like 30k tensors", moe_layout(328 << 20, 30_000), args.repeats),
    ]
    print(f"device: {torch.cuda.get_device_name(0)}")
    for row in rows:
        print(
            " | ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    from wt_tools import digest_bench
    from wt_tools.report import digest_table

    digest = digest_bench.measure(max(10, 3 * args.repeats), device="cuda:0")
    print("\n".join(digest_table(digest)))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(0), "rows": rows, "digest": digest}, f, indent=2
        )
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
