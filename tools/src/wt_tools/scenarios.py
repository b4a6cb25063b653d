"""Transport-alone scenarios: every backend into plain targets, against the machine's ceilings.

A scenario is a layout (dense, LLM-like; or MoE-like, thousands of small
tensors), a number of worker processes (`wt_tools.workers`: plain targets
that copy in place, so the transport is what is timed) and the modes to run.
In one run, interleaved round by round, each scenario times:

- references on the same bytes: a one-thread `memcpy` (the machine's
  ceiling) and a bare broadcast over a bare gloo group to the same workers
  (the transport's ceiling);
- each mode: `nccl packed` / `nccl unpacked`, `sparse_nccl 1%` / `10%`
  (patches of that density on every tensor), `ipc packed`, `sharded_rdt`
  (NIXL; the workers join the bench's Ray cluster); `nccl packed verify` /
  `ipc packed verify` (verified bytes: digests sent and checked per bucket),
  each also reported as a ratio to its unverified mode (`x_unverified`);
- the trainer's own work per parameter: iterating the source (with its
  checks) and packing the buckets, no wire, minus a memcpy of the same bytes,
  divided by the number of parameters;
- peak extra resident memory of the trainer (this process) and of the
  workers while the mode's syncs ran, against its configured staging;
- each full-resync mode's counted costs: one more warm round after the
  timed ones, counted on the trainer and in the first worker
  (`wt_tools.costs`: control calls, wire messages, host reads, the trainer
  thread's aten ops, bytes copied and allocations, the worker's unpacking).

After each full-resync mode's rounds the workers' checksums must equal the
trainer's tensors. Figures are medians; every wt figure is also reported as
a ratio to each reference of the same scenario.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer import WeightSource
from weight_transfer.testing.models import TensorSource
from wt_kits.stream import PlanCache, RotatingBuffers, WireParams
from wt_tools.costs import count_round
from wt_tools.counting import CountedClient
from wt_tools.workers import LayoutEntry, WorkerProcesses, checksum, peak_rss_bytes, reset_peak_rss

__all__ = ["Scenario", "dense_layout", "moe_layout", "run_scenario", "scenarios_for"]

FULL_MODES = ("nccl packed", "nccl unpacked", "ipc packed", "sharded_rdt")
SPARSE_MODES = ("sparse_nccl 1%", "sparse_nccl 10%")
VERIFY_SUFFIX = " verify"
VERIFY_MODES = ("nccl packed verify", "ipc packed verify")
BARE_CHUNK = 256 << 20


def dense_layout(nbytes: int, hidden: int = 1024) -> list[LayoutEntry]:
    """Llama-like float32 layers (attention, MLP, two norms) totalling about `nbytes`."""
    h = hidden
    per_layer = (4 * h * h + 12 * h * h + 2 * h) * 4
    out: list[LayoutEntry] = []
    for i in range(max(1, round(nbytes / per_layer))):
        p = f"layers.{i}."
        out += [
            (p + n, (h, h), "float32") for n in ("q.weight", "k.weight", "v.weight", "o.weight")
        ]
        out += [
            (p + "gate.weight", (4 * h, h), "float32"),
            (p + "up.weight", (4 * h, h), "float32"),
        ]
        out += [(p + "down.weight", (h, 4 * h), "float32")]
        out += [(p + "norm1.weight", (h,), "float32"), (p + "norm2.weight", (h,), "float32")]
    return out


def moe_layout(nbytes: int, num_params: int, experts: int = 64) -> list[LayoutEntry]:
    """MoE-like bf16 layers: a norm, a router and `experts` x 3 small expert tensors
    per layer, about `num_params` tensors of about `nbytes` in all."""
    per_layer = 2 + 3 * experts
    layers = max(1, math.ceil(num_params / per_layer))
    numel = max(64, nbytes // (layers * per_layer * 2))
    rows = max(1, numel // 64)
    out: list[LayoutEntry] = []
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "norm.weight", (64,), "bfloat16"),
            (p + "router.weight", (experts, 64), "bfloat16"),
        ]
        for e in range(experts):
            for w in ("w1", "w2", "w3"):
                out.append((f"{p}experts.{e}.{w}.weight", (rows, 64), "bfloat16"))
    return out


@dataclass
class Scenario:
    name: str
    layout: list[LayoutEntry]
    workers: int
    modes: Sequence[str]
    repeats: int

    @property
    def nbytes(self) -> int:
        from weight_transfer.backend import dtype_from_name

        return sum(
            math.prod(s) * dtype_from_name(d, field="layout").itemsize for _, s, d in self.layout
        )


def scenarios_for(quick: bool, repeats: int) -> list[Scenario]:
    """The scenario list (`quick`: small ones for a smoke run)."""
    every = (*FULL_MODES, *VERIFY_MODES, *SPARSE_MODES)
    if quick:
        return [
            Scenario("dense 64 MiB, 1 worker", dense_layout(64 << 20, 512), 1, every, 1),
            Scenario(
                "dense 64 MiB, 2 workers",
                dense_layout(64 << 20, 512),
                2,
                ("nccl packed", "nccl packed verify"),
                1,
            ),
            Scenario("MoE-like 600 tensors, 8 MiB", moe_layout(8 << 20, 600), 1, every, 1),
        ]
    return [
        Scenario("dense 256 MiB, 1 worker", dense_layout(256 << 20), 1, every, repeats),
        Scenario("dense 256 MiB, 2 workers", dense_layout(256 << 20), 2, FULL_MODES, repeats),
        Scenario("dense 256 MiB, 3 workers", dense_layout(256 << 20), 3, FULL_MODES, repeats),
        Scenario("dense 1 GiB, 1 worker", dense_layout(1 << 30), 1, every, repeats),
        Scenario(
            "dense 4 GiB, 1 worker", dense_layout(4 << 30), 1, ("nccl packed", "ipc packed"), 1
        ),
        # unpacked costs milliseconds per tensor: it runs on the smaller MoE layout only
        Scenario("MoE-like 4.7k tensors, 328 MiB", moe_layout(328 << 20, 4_700), 1, every, 1),
        Scenario(
            "MoE-like 30k tensors, 328 MiB",
            moe_layout(328 << 20, 30_000),
            1,
            tuple(m for m in every if m != "nccl unpacked"),
            repeats,
        ),
    ]


def _random_tensors(layout: Sequence[LayoutEntry], seed: int) -> dict[str, torch.Tensor]:
    from weight_transfer.backend import dtype_from_name

    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(s, generator=g).to(dtype_from_name(d, field="layout")) for n, s, d in layout
    }


def _patches(tensors: dict[str, torch.Tensor], density: float, seed: int) -> list[Any]:
    from wt_sparse_nccl.patch import SparseWeightPatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tensors.items():
        nnz = max(1, int(t.numel() * density))
        idx = torch.randperm(t.numel(), generator=g)[:nnz].to(torch.int32)
        out.append(SparseWeightPatch(name, idx, t.reshape(-1)[idx.long()], tuple(t.shape)))
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _trainer_dry_pass(source: WeightSource, buffers: Any, plans: Any) -> None:
    """What the nccl trainer does per round without the wire: checked iteration + packing
    into `buffers` (a `RotatingBuffers` reused round after round, as the engine's are),
    by the layout `plans` (a `PlanCache`) keeps."""
    from weight_transfer.backend import checked_iteration
    from wt_kits.stream import Packer

    metas = source.metadata()
    plan = plans(metas)
    packer = Packer(plan, checked_iteration(metas, source), finite=True)
    for k in range(len(plan.buckets)):
        packer.pack(k, buffers)
    packer.exhaust()


def _connect(
    mode: str, workers: WorkerProcesses, n: int, source: WeightSource
) -> tuple[Any, int, CountedClient]:
    """The trainer engine of `mode`, its configured staging bytes and its counted client."""
    from weight_transfer.factory import WeightTransferTrainerFactory
    from wt_kits.group.stateless import free_port
    from wt_kits.stream import WireParams

    info: Any
    staging = 0
    verify = mode.endswith(VERIFY_SUFFIX)
    if mode.startswith("nccl"):
        from wt_nccl import NCCLTrainerInitInfo

        packed = mode.startswith("nccl packed")
        info = NCCLTrainerInitInfo(
            "127.0.0.1", free_port(), n + 1, rank=0, device="cpu", packed=packed, verify=verify
        )
        wire = WireParams()
        buffers = wire.packed_num_buffers * wire.packed_buffer_size_bytes
        backend, staging = "nccl", buffers if packed else 0
    elif mode.startswith("sparse"):
        from wt_sparse_nccl import SparseNCCLTrainerInitInfo

        info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), n + 1, rank=0, device="cpu")
        backend = "sparse_nccl"
    elif mode.startswith("ipc packed"):
        from wt_ipc import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0, device="cpu", num_workers=n, verify=verify)
        backend, staging = "ipc", info.packed_num_buffers * info.packed_buffer_size_bytes
    else:
        from wt_sharded_rdt import ShardedRDTTrainerInitInfo

        info = ShardedRDTTrainerInitInfo(
            rank=0, num_consumers=n, transport="nixl", producer_prefix=f"wt-bench-{free_port()}"
        )
        backend = "sharded_rdt"
    client = CountedClient(workers.client(backend, mode))
    trainer: Any = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=None if backend == "sparse_nccl" else source
    )
    return trainer, staging, client


def _counted_round(mode: _Mode, workers: WorkerProcesses, source: WeightSource) -> dict[str, Any]:
    """One more warm round of `mode`, counted on the trainer and in the first worker
    (`wt_tools.costs`), with the bucket count of its plan where it has one."""
    counts = count_round(mode.trainer.send_weights, mode.client, workers)
    plan_for = getattr(mode.trainer, "plan_for", None)
    counts["buckets"] = len(plan_for(source.metadata()).buckets) if plan_for else None
    return counts


class _BareBroadcast:
    """A bare gloo group with the workers, kept for the whole scenario: the transport's ceiling."""

    def __init__(self, workers: WorkerProcesses, nbytes: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from wt_kits.group import StatelessGroup
        from wt_kits.group.auth import new_secret
        from wt_kits.group.stateless import free_port

        self.workers, self.nbytes = workers, nbytes
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="wt-bench-bare")
        self.payload = torch.ones(min(nbytes, BARE_CHUNK), dtype=torch.uint8)
        port, secret = free_port(), new_secret()
        joined = self.pool.submit(workers.call, "bare_join", port, secret, nbytes, BARE_CHUNK)
        self.group = StatelessGroup.create(
            host="127.0.0.1", port=port, rank=0, world_size=len(workers.processes) + 1,
            secret=secret, timeout_s=300.0, name="bare",
        )  # fmt: skip
        joined.result(300)

    def __call__(self) -> None:
        received = self.pool.submit(self.workers.call, "bare_broadcast")
        for start in range(0, self.nbytes, BARE_CHUNK):
            size = min(BARE_CHUNK, self.nbytes - start)
            self.group.wait(self.group.broadcast(self.payload[:size]), "the bare broadcast")
        received.result(300)

    def close(self) -> None:
        left = self.pool.submit(self.workers.call, "bare_leave")
        self.group.close()
        left.result(60)
        self.pool.shutdown()


@dataclass
class _Mode:
    name: str
    trainer: Any
    staging: int
    client: CountedClient
    times: list[float] = field(default_factory=list)
    counts: dict[str, Any] | None = None
    bytes_per_worker: int = 0
    peak_trainer: int = 0
    peak_worker: int = 0


def run_scenario(sc: Scenario, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `sc` (see the module docstring); every figure in a JSON-safe dict."""
    # two targets alternate round by round (above 1 GiB the same one twice, for memory)
    targets = [_random_tensors(sc.layout, 1)]
    targets.append(_random_tensors(sc.layout, 2) if sc.nbytes <= 1 << 30 else targets[0])
    source = TensorSource(targets[0])
    nbytes = sc.nbytes
    flat = [t for t in targets[0].values()]
    copies = [torch.empty_like(t) for t in flat]
    dry_buffers = RotatingBuffers(2, "cpu")
    dry_plans = PlanCache(WireParams().packed_plan)

    def memcpy() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for dst, src in zip(copies, flat, strict=True):
                dst.copy_(src)
        finally:
            torch.set_num_threads(threads)

    refs: dict[str, list[float]] = {"memcpy": [], "bare broadcast": [], "trainer dry pass": []}
    result: dict[str, Any] = {
        "scenario": sc.name,
        "bytes": nbytes,
        "params": len(sc.layout),
        "workers": sc.workers,
    }
    with WorkerProcesses(sc.layout, sc.workers) as workers:
        modes: list[_Mode] = []
        for name in sc.modes:
            trainer, staging, client = _connect(name, workers, sc.workers, source)
            modes.append(_Mode(name, trainer, staging, client))
        memcpy()
        bare = _BareBroadcast(workers, nbytes)
        for r in range(sc.repeats + 1):  # round 0 warms up every path
            source.tensors = targets[r % 2]
            flat[:] = list(source.tensors.values())
            refs["memcpy"].append(_timed(memcpy))
            refs["bare broadcast"].append(_timed(bare))
            refs["trainer dry pass"].append(
                _timed(functools.partial(_trainer_dry_pass, source, dry_buffers, dry_plans))
            )
            for mode in modes:
                base_trainer = reset_peak_rss()
                base_workers = workers.call("reset_peak")
                if mode.name.startswith("sparse"):
                    density = float(mode.name.split()[1].rstrip("%")) / 100
                    patches = _patches(source.tensors, density, seed=r)
                    mode.bytes_per_worker = sum(p.nbytes for p in patches)
                    seconds = _timed(functools.partial(mode.trainer.send_weights, patches))
                else:
                    mode.bytes_per_worker = nbytes
                    seconds = _timed(mode.trainer.send_weights)
                mode.peak_trainer = max(mode.peak_trainer, peak_rss_bytes() - base_trainer)
                peaks = workers.call("peak_rss")
                mode.peak_worker = max(
                    mode.peak_worker, *(p - b for p, b in zip(peaks, base_workers, strict=True))
                )
                if r:
                    mode.times.append(seconds)
                if not mode.name.startswith("sparse"):
                    want = checksum(list(source.tensors.values()))
                    got = workers.call("checksum")
                    if any(g != want for g in got):
                        raise RuntimeError(f"{sc.name}: {mode.name} delivered different bytes")
            log(f"  round {r}/{sc.repeats} done")
        for mode in modes:
            if not mode.name.startswith("sparse"):
                mode.counts = _counted_round(mode, workers, source)
            mode.trainer.shutdown()
        bare.close()
    ref = {k: statistics.median(v[1:]) for k, v in refs.items()}
    per_param_us = max(0.0, ref["trainer dry pass"] - ref["memcpy"]) / len(sc.layout) * 1e6
    result["references"] = {
        "memcpy_s": ref["memcpy"],
        "bare_broadcast_s": ref["bare broadcast"],
        "trainer_dry_pass_s": ref["trainer dry pass"],
        "trainer_overhead_per_param_us": per_param_us,
    }
    rows = []
    for mode in modes:
        med = statistics.median(mode.times)
        rows.append(
            {
                "mode": mode.name,
                "median_s": med,
                "times_s": mode.times,
                "gb_per_s": mode.bytes_per_worker / 1e9 / med,
                "x_memcpy": med / ref["memcpy"],
                "x_bare_broadcast": med / ref["bare broadcast"],
                "bytes_per_worker": mode.bytes_per_worker,
                "peak_extra_trainer_bytes": mode.peak_trainer,
                "peak_extra_worker_bytes": mode.peak_worker,
                "staging_bytes": mode.staging,
                **({"counts": mode.counts} if mode.counts else {}),
            }
        )
    medians = {mode.name: statistics.median(mode.times) for mode in modes}
    for row, mode in zip(rows, modes, strict=True):  # verified bytes, beside the same mode plain
        plain = mode.name.removesuffix(VERIFY_SUFFIX)
        if plain != mode.name and plain in medians:
            row["x_unverified"] = medians[mode.name] / medians[plain]
    result["modes"] = rows
    return result
