"""The live-engine block of the bench: wt into a live vLLM, beside vLLM's own paths.

`measure(layers, repeats, work)` builds a Llama of about 1 GiB in float32
(hidden 1024, 16 layers), starts one vLLM engine per backend (`wt_nccl`,
`wt_ipc`, `wt_sharded_rdt`), each in a process of its own as vLLM runs by
default, and times `BLOCKS`, interleaved over `repeats` rounds of alternating
weights. What is timed is declared in `BLOCKS`: a block is the rows one
trainer engine serves (one trainer holds a worker's channel at a time), its
first row the floor its ratios are against, all on the same cores. A row is
one of

- `floor`: vLLM's own reload of the same tensors from memory
  (`model_runner.reload_weights(weights_iterator=...)`, the tensors drawn in
  the engine's process), no transport;
- `sync`: a trainer in this process pushing a `ModuleSource` through
  `LocalVLLMWeightSyncClient` with the row's wire parameters (`WIRES`);
- `save_reload`: a safetensors checkpoint written, then `reload_weights`
  from it (what users do without a sync library).

A row's `cores` (`wt_tools.pinning`): `shared`, trainer and engines on every
core (colocated); `disjoint`, the trainer's processes on half the cores and
the engines' on the other half, as deployments run (the trainer computes on
devices of its own), the floor pinned the same way.

The steps, in order (`measure`): `start`, `time_blocks`, `check_tokens`,
`summarize`, `print_tables`, then `tensor_parallel` (sharded_rdt's bytes per
worker for engines of 1, 2 and 4 workers, `wt_tools.sharded_bench`) and
`ipc_transport` (the ipc transport alone, no vLLM, against a memcpy; then
100 more syncs and /dev/shm and RSS growth). Every wt row reports where
its time goes (`weight_transfer.runtime.phases`) and its engine's undo
record. Rows and figures carry stable ids; the goals
(`wt_tools.goals`) are checked by `wt_tools.report`.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from weight_transfer.runtime.phases import PHASES, PhaseClock
from wt_tools.goals import GOALS
from wt_tools.pinning import Cores, Pinning, engine_processes
from wt_tools.tiny_model import TinyLlamaSpec, build_tiny_llama, tiny_llama

__all__ = ["BLOCKS", "Row", "measure", "in_fresh_process"]

BACKENDS = ("nccl", "ipc", "sharded_rdt")
SEEDS = (1, 2)  # the two targets rounds alternate between
PROMPT = "w1 w2 w3 w4"


@dataclass(frozen=True)
class Row:
    """One timed path. `id` is what reports and goals look it up by; `label` is printed."""

    id: str
    label: str
    kind: Literal["floor", "sync", "save_reload"]
    backend: str  # the engine it runs against
    wire: str = "default"  # a key of `WIRES` (sync rows)
    check_finite: bool = True
    cores: Cores = "shared"  # `wt_tools.pinning`: all rows of a block share it


BLOCKS: tuple[tuple[Row, ...], ...] = (
    (
        Row("floor.nccl", "floor: vLLM reload from memory", "floor", "nccl"),
        Row("nccl.packed", "wt_nccl packed", "sync", "nccl"),
        Row("nccl.packed_no_finite", "wt_nccl packed, no finite check", "sync", "nccl",
            check_finite=False),
        Row("save_reload.nccl", "save + reload_weights", "save_reload", "nccl"),
    ),
    (
        Row("floor.nccl_unpacked", "floor (unpacked block)", "floor", "nccl"),
        Row("nccl.unpacked", "wt_nccl unpacked", "sync", "nccl", wire="unpacked"),
    ),
    (
        Row("floor.ipc", "floor (ipc engine)", "floor", "ipc"),
        Row("ipc.packed", "wt_ipc packed", "sync", "ipc"),
        Row("ipc.packed_no_finite", "wt_ipc packed, no finite check", "sync", "ipc",
            check_finite=False),
        Row("save_reload.ipc", "save + reload (ipc engine)", "save_reload", "ipc"),
    ),
    (
        Row("floor.ipc_staging", "floor (ipc staging block)", "floor", "ipc"),
        Row("ipc.packed_model_staging", "wt_ipc packed, staging ~ model", "sync", "ipc",
            wire="model_sized"),
    ),
    (
        Row("floor.ipc_unpacked", "floor (ipc unpacked block)", "floor", "ipc"),
        Row("ipc.unpacked", "wt_ipc unpacked", "sync", "ipc", wire="unpacked"),
    ),
    (
        Row("floor.sharded_rdt", "floor (sharded_rdt engine)", "floor", "sharded_rdt"),
        Row("sharded_rdt.nixl", "wt_sharded_rdt (nixl)", "sync", "sharded_rdt"),
    ),
    # as deployments run: the trainer's processes and the engine's on disjoint cores
    (
        Row("floor.nccl_disjoint", "floor, disjoint cores", "floor", "nccl", cores="disjoint"),
        Row("nccl.packed_disjoint", "wt_nccl packed, disjoint cores", "sync", "nccl",
            cores="disjoint"),
    ),
    (
        Row("floor.ipc_disjoint", "floor (ipc), disjoint cores", "floor", "ipc",
            cores="disjoint"),
        Row("ipc.packed_disjoint", "wt_ipc packed, disjoint cores", "sync", "ipc",
            cores="disjoint"),
    ),
    (
        Row("floor.sharded_rdt_disjoint", "floor (sharded_rdt), disjoint cores", "floor",
            "sharded_rdt", cores="disjoint"),
        Row("sharded_rdt.nixl_disjoint", "wt_sharded_rdt (nixl), disjoint cores", "sync",
            "sharded_rdt", cores="disjoint"),
    ),
)  # fmt: skip


def wires(model_bytes: int) -> dict[str, dict[str, Any]]:
    """The wire parameters a sync row names. `model_sized`: staging about the model's
    size (16 buffers), so the trainer is done writing before the load needs the
    cores it shares with it."""
    return {
        "default": {},
        "unpacked": {"packed": False},
        "model_sized": {
            "packed_num_buffers": 16,
            "packed_buffer_size_bytes": -(-model_bytes // (15 << 20)) << 20,
        },
    }


@dataclass
class LiveBench:
    """The engines, trainers and targets of one live run; each step a method."""

    layers: int
    repeats: int
    work: str
    spec: TinyLlamaSpec = field(init=False)
    targets: list[torch.nn.Module] = field(init=False)
    nbytes: int = field(init=False)
    llms: dict[str, Any] = field(default_factory=dict)
    clients: dict[str, Any] = field(default_factory=dict)
    sources: list[Any] = field(default_factory=list)
    trainers: dict[str, tuple[Mapping[str, Any], Any]] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    pinning: Pinning | None = None

    def __post_init__(self) -> None:
        self.spec = TinyLlamaSpec.large(num_hidden_layers=self.layers)
        self.targets = [tiny_llama(self.spec, seed=s) for s in SEEDS]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.targets[0].parameters())
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    # -- steps ---------------------------------------------------------------------------

    def start(self) -> None:
        """One vLLM engine per backend on the served checkpoint, and its client."""
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from weight_transfer import LocalVLLMWeightSyncClient, ModuleSource

        served = build_tiny_llama(os.path.join(self.work, "served"), seed=0, spec=self.spec)
        extra: dict[str, Any] = (
            {} if self.device == "cuda" else {"kv_cache_memory_bytes": 256 << 20}
        )
        print(
            f"live engines: {self.layers} layers, {self.nbytes / 2**30:.2f} GiB float32; "
            f"repeats {self.repeats}"
        )

        def engine(backend: str) -> Any:
            return LLM(
                model=served,
                dtype="float32",
                enforce_eager=True,
                max_model_len=256,
                distributed_executor_backend="uni",
                weight_transfer_config=WeightTransferConfig(backend=f"wt_{backend}"),
                **extra,
            )

        staged = []  # the floor's tensors, mapped by every engine: one copy in the page cache
        for i, target in enumerate(self.targets):
            staged.append(os.path.join(self.work, f"target-{i}.pt"))
            torch.save({n: p.detach() for n, p in target.named_parameters()}, staged[-1])
        engine_pids: set[int] = set()
        for backend in BACKENDS:
            self.llms[backend], pids = engine_processes(functools.partial(engine, backend))
            engine_pids |= pids
            self.clients[backend] = LocalVLLMWeightSyncClient(self.llms[backend])
            self.llms[backend].collective_rpc(_stage_targets, args=(staged,))
        self.sources = [ModuleSource(m) for m in self.targets]
        if self.device == "cpu":  # else (or where cores cannot split) no disjoint rows
            self.pinning = engines_pinning(list(self.llms.values()), engine_pids)

    def time_blocks(self) -> None:
        """Each block: one warm-up pass, then `repeats` interleaved rounds of its rows."""
        for block in self.blocks():
            if self.pinning is not None:
                self.pinning.apply(block[0].cores)
            for row in block:  # first touches, allocator growth
                self.prepare(row, 1)()
            for r in range(self.repeats):
                for row in block:
                    run = self.prepare(row, r % 2)
                    seconds, phases = timed_round(run, self.llms[row.backend], row.kind == "sync")
                    self.times.setdefault(row.id, []).append(seconds)
                    if phases is not None:
                        self.phases.setdefault(row.id, []).append(phases)
        if self.pinning is not None:
            self.pinning.apply("shared")

    def blocks(self) -> list[tuple[Row, ...]]:
        """`BLOCKS`, less the disjoint-core ones where cores cannot be split (a GPU
        trainer has its own device already)."""
        return [b for b in BLOCKS if b[0].cores == "shared" or self.pinning is not None]

    def check_tokens(self) -> None:
        """What each engine serves after a sync equals what it serves after vLLM's reload."""
        last = (self.repeats - 1) % 2
        for backend, llm in self.llms.items():
            self.prepare(Row("check.floor", "", "floor", backend), last)()
            after_reload = _greedy(llm)
            sync = Row("check.sync", "", "sync", backend)
            self.prepare(sync, 1 - last)()
            self.prepare(sync, last)()
            if _greedy(llm) != after_reload:
                raise RuntimeError(f"tokens after wt_{backend} differ from after vLLM's reload")

    def summarize(self) -> list[dict[str, Any]]:
        """Per row: medians, ratio to its block's floor, bytes per worker, undo, phases."""
        pulled = self.pulled_bytes()
        undo = {b: llm.collective_rpc(_undo_cost)[0] for b, llm in self.llms.items()}
        rows: list[dict[str, Any]] = []
        for block in self.blocks():
            base = statistics.median(self.times[block[0].id])
            for row in block:
                med = statistics.median(self.times[row.id])
                synced = row.kind == "sync"
                rows.append(
                    {
                        "id": row.id,
                        "method": row.label,
                        "backend": row.backend,
                        "cores": row.cores,
                        "kind": row.kind,
                        "median_s": med,
                        "times_s": self.times[row.id],
                        "ratio_to_floor": med / base,
                        "bytes_per_worker": (
                            (pulled if row.backend == "sharded_rdt" else self.nbytes)
                            if synced
                            else None
                        ),
                        "undo": undo[row.backend] if synced else None,
                        "phases_s": median_phases(self.phases[row.id]) if synced else None,
                    }
                )
        return rows

    def print_tables(self, rows: list[dict[str, Any]]) -> None:
        print(
            f"\n{'method':<34} {'median s':>9} {'GB/s':>7} {'x floor':>8} {'MB/worker':>10} "
            f"{'undo s':>7} {'undo MB copied/kept':>20}"
        )
        for r in rows:
            moved = (
                f"{r['bytes_per_worker'] / 1e6:10.1f}" if r["bytes_per_worker"] else f"{'-':>10}"
            )
            cost = r["undo"]
            kept = (
                f"{cost['seconds']:7.3f} {cost['copied_bytes'] / 1e6:9.1f}/"
                f"{cost['kept_bytes'] / 1e6:<10.1f}"
                if cost
                else ""
            )
            print(
                f"{r['method']:<34} {r['median_s']:9.3f} {self.nbytes / 1e9 / r['median_s']:7.2f} "
                f"{r['ratio_to_floor']:8.2f} {moved} {kept}"
            )
        print(
            "\nwhere a round's time goes (seconds summed over threads, so shares may add past 1; "
            "wire: the trainer waiting on its sends):"
        )
        print(f"{'method':<34} " + " ".join(f"{p:>13}" for p in PHASES))
        for r in rows:
            if r["phases_s"]:
                seconds = r["phases_s"]
                shares = [f"{seconds[p]:6.3f} {seconds[p] / r['median_s']:5.0%}" for p in PHASES]
                print(f"{r['method']:<34} " + " ".join(f"{s:>13}" for s in shares))

    def shutdown_trainers(self) -> None:
        for _, trainer in self.trainers.values():
            trainer.shutdown()
        self.trainers.clear()

    def shutdown_engines(self) -> None:
        """Stop the engines' processes (the later steps start engines of their own)."""
        for llm in self.llms.values():
            llm.llm_engine.engine_core.shutdown()
        self.llms.clear()

    # -- what a row runs -----------------------------------------------------------------

    def prepare(self, row: Row, i: int) -> Callable[[], None]:
        """`row` against target `i`: set up untimed, return the timed call."""
        if row.kind == "floor":
            return lambda: self.llms[row.backend].collective_rpc(reload_staged, args=(i,))
        if row.kind == "save_reload":
            return lambda: self.save_and_reload(row.backend, i)
        trainer = self.trainer(row.backend, wires(self.nbytes)[row.wire])
        trainer.source = self.sources[i]
        trainer.check_finite = row.check_finite
        return trainer.send_weights

    def trainer(self, backend: str, wire: Mapping[str, Any]) -> Any:
        """`backend`'s trainer engine for `wire`; a new one (untimed) when the wire changes."""
        from weight_transfer.factory import WeightTransferTrainerFactory
        from wt_ipc import IPCTrainerInitInfo
        from wt_kits.group.stateless import free_port
        from wt_nccl import NCCLTrainerInitInfo
        from wt_sharded_rdt import ShardedRDTTrainerInitInfo

        if backend in self.trainers:
            current, engine = self.trainers[backend]
            if current == wire:
                return engine
            engine.shutdown()
        info: Any
        if backend == "nccl":
            info = NCCLTrainerInitInfo(
                "127.0.0.1", free_port(), 2, rank=0, device=self.device, **wire
            )
        elif backend == "sharded_rdt":
            prefix = f"wt-bench-{free_port()}"
            info = ShardedRDTTrainerInitInfo(
                rank=0, num_consumers=1, producer_prefix=prefix, **wire
            )
        else:
            info = IPCTrainerInitInfo(rank=0, device=self.device, **wire)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.clients[backend], source=self.sources[0]
        )
        self.trainers[backend] = (dict(wire), engine)
        return engine

    def save_and_reload(self, backend: str, i: int) -> None:
        from safetensors.torch import save_file

        ckpt = os.path.join(self.work, "ckpt")
        os.makedirs(ckpt, exist_ok=True)
        state = {n: p.detach().contiguous() for n, p in self.targets[i].named_parameters()}
        save_file(state, os.path.join(ckpt, "model.safetensors"))
        self.llms[backend].collective_rpc(
            "reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True}
        )

    def pulled_bytes(self) -> int:
        return int(self.llms["sharded_rdt"].collective_rpc(_pulled_bytes)[0])


def measure(layers: int, repeats: int, work: str) -> dict[str, Any]:
    """Every figure of the live block, as a dict (printed as it goes)."""
    bench = LiveBench(layers, repeats, work)
    with engine_environment():
        bench.start()
        bench.time_blocks()
        bench.check_tokens()
        rows = bench.summarize()
        bench.print_tables(rows)
        bench.shutdown_trainers()
        bench.shutdown_engines()
    pulled = next(r["bytes_per_worker"] for r in rows if r["id"] == "sharded_rdt.nixl")
    sharded = tensor_parallel(layers, repeats)
    transport = in_fresh_process(ipc_transport, bench.spec, repeats)
    ipc = ipc_summary({r["id"]: r for r in rows}, transport)
    print()
    for line in transport.pop("lines"):
        print(line)
    print(ipc.pop("line"))
    return {
        "bytes": bench.nbytes,
        "layers": layers,
        "repeats": repeats,
        "rows": rows,
        "ipc": {**ipc, **transport},
        "bytes_per_worker": {"nccl": bench.nbytes, "ipc": bench.nbytes, "sharded_rdt": pulled},
        "sharded_rdt_tp": sharded,
    }


def tensor_parallel(layers: int, repeats: int) -> list[dict[str, Any]]:
    """sharded_rdt's bytes per worker for tensor-parallel engines of 1, 2 and 4 workers."""
    from wt_tools.sharded_bench import measure as sharded_measure

    rows = [
        sharded_measure(tp, layers=2 if layers <= 2 else 8, repeats=repeats) for tp in (1, 2, 4)
    ]
    print("\nsharded_rdt, tensor-parallel engines (sharded MLP stack, loopback transport):")
    print(f"{'workers':>7} {'model MB':>9} {'MB per worker':>14} {'share':>6} {'sync s':>7}")
    for row in rows:
        per = max(row["bytes_per_worker"])
        print(
            f"{row['tp']:>7} {row['model_bytes'] / 1e6:9.1f} {per / 1e6:14.1f} "
            f"{per / row['model_bytes']:6.2f} {row['seconds']:7.3f}"
        )
    return rows


def ipc_summary(rows: dict[str, dict[str, Any]], transport: dict[str, Any]) -> dict[str, Any]:
    """wt_ipc against its floor and save + reload, and where the difference goes."""
    ipc, floor = rows["ipc.packed"], rows["floor.ipc"]
    ratio = ipc["ratio_to_floor"]
    speedup = rows["save_reload.ipc"]["median_s"] / ipc["median_s"]
    staged = rows["ipc.packed_model_staging"]["ratio_to_floor"]
    line = (
        f"wt_ipc packed: {ratio:.2f}x its floor (goal {GOALS['live.ipc_vs_floor'].describe()}), "
        f"{speedup:.2f}x faster than save + reload "
        f"(goal {GOALS['live.ipc_over_save_reload'].describe()}). Where the time goes: vLLM's "
        f"load (the floor) {floor['median_s']:.3f} s; the transfer alone "
        f"{transport['transport_no_undo_s']:.3f} s; the sync adds "
        f"{ipc['median_s'] - floor['median_s']:+.3f} s to the floor: the part of the transfer "
        "(the trainer's copy into staging, and the finite check where on) not hidden behind the "
        "load, which shares the same cores and memory bus. With staging about the model's size "
        f"the trainer is done writing before the load needs the cores: {staged:.2f}x the floor"
    )
    return {"ratio_to_floor": ratio, "speedup_over_save_reload": speedup, "line": line}


def in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a spawned interpreter (vLLM pins this process's threads), which
    may start processes of its own (vLLM's engine cores); `fn`'s error is raised here
    with its traceback."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    child = context.Process(target=_run_and_send, args=(theirs, fn, args), daemon=False)
    child.start()
    theirs.close()
    try:
        ok, value = ours.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"{fn.__name__} died (exit code {child.exitcode})") from None
    finally:
        ours.close()
    child.join(_CHILD_EXIT_S)
    if child.is_alive():  # its result is in: stop whatever keeps it from exiting
        child.terminate()
        child.join(_CHILD_EXIT_S)
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its process:\n{value}")
    return value


_CHILD_EXIT_S = 60.0


def _run_and_send(conn: Any, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> None:
    import traceback

    try:
        result: tuple[bool, Any] = (True, fn(*args))
    except BaseException:
        result = (False, traceback.format_exc())
    conn.send(result)
    conn.close()


def ipc_transport(spec: TinyLlamaSpec, repeats: int) -> dict[str, Any]:
    """The ipc transport alone: a trainer and a plain-module worker in one process.

    The worker is driven through core's `WorkerSession` (the trainer's client),
    so its receive step runs on the trainer's update thread while the trainer
    packs, as a colocated engine's would in its own process. Timed into a
    module loaded by `DirectLoader` (with undo) and by a loader without undo,
    interleaved with a one-thread memcpy of the same bytes; then 100 more
    syncs, after which /dev/shm usage and RSS are compared with their values
    after the first.
    """
    from weight_transfer import (
        ModuleSource,
        WeightTransferConfig,
        WeightTransferEngineFactory,
        WorkerPosition,
        WorkerSession,
    )
    from weight_transfer.factory import WeightTransferTrainerFactory
    from weight_transfer.loading import register_loader_provider
    from weight_transfer.runtime.direct_loader import DirectLoader
    from wt_ipc import IPCTrainerInitInfo

    targets = [tiny_llama(spec, seed=s) for s in (1, 2)]
    sources = [ModuleSource(m) for m in targets]
    plain, bare = tiny_llama(spec, seed=3), tiny_llama(spec, seed=4)
    register_loader_provider(
        lambda model, _: DirectLoader(model, undo=False) if model is bare else None
    )

    def connect(model: torch.nn.Module) -> tuple[Any, Any]:
        worker = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig("ipc"), WorkerPosition(), "cpu", model
        )
        trainer: Any = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, device="cpu"),
            client=WorkerSession(worker),
            source=sources[0],
        )
        trainer.check_finite = False  # the transport alone
        return trainer, worker

    pairs = [
        (dst.detach(), src.detach())
        for dst, src in zip(plain.parameters(), targets[0].parameters(), strict=True)
    ]
    nbytes = sum(src.numel() * src.element_size() for _, src in pairs)

    def memcpy() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for dst, src in pairs:
                dst.copy_(src)
        finally:
            torch.set_num_threads(threads)

    def timed(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    engines = {"undo": connect(plain), "no undo": connect(bare)}
    memcpy()  # touch the destination
    times: dict[str, list[float]] = {"memcpy": [], "undo": [], "no undo": []}
    for r in range(repeats + 1):  # the first round warms up
        times["memcpy"].append(timed(memcpy))
        for name, (trainer, _) in engines.items():
            trainer.source = sources[r % 2]
            times[name].append(timed(trainer.send_weights))
    for model in (plain, bare):
        for got, want in zip(model.parameters(), targets[repeats % 2].parameters(), strict=True):
            if not torch.equal(got, want):
                raise RuntimeError("the ipc transport delivered different bytes")
    med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    trainer, worker = engines["undo"]
    shm_first, rss_first = _shm_used_bytes(), _rss_bytes()
    for r in range(100):
        trainer.source = sources[r % 2]
        trainer.send_weights()
    shm_grew = _shm_used_bytes() - shm_first
    rss_grew = _rss_bytes() - rss_first
    for trainer, worker in engines.values():
        trainer.shutdown()
        worker.shutdown()

    def rate(seconds: float) -> str:
        return f"{seconds:.3f} s ({nbytes / 1e9 / seconds:.2f} GB/s)"

    share = GOALS["ipc_transport.share_of_memcpy"]
    lines = [
        f"one-thread memcpy of the same bytes: {rate(med['memcpy'])}",
        f"ipc transport, no vLLM, loader without undo: {rate(med['no undo'])}, "
        f"{med['memcpy'] / med['no undo']:.0%} of the memcpy (goal {share.describe()})",
        f"ipc transport, no vLLM, DirectLoader (undo copy): {rate(med['undo'])}, "
        f"{med['memcpy'] / med['undo']:.0%} of the memcpy",
        f"after 100 more syncs: /dev/shm used {shm_grew / 2**20:+.1f} MiB, RSS "
        f"{rss_grew / 2**20:+.1f} MiB",
    ]
    return {
        "memcpy_1thread_s": med["memcpy"],
        "transport_no_undo_s": med["no undo"],
        "transport_direct_loader_s": med["undo"],
        "share_of_memcpy": med["memcpy"] / med["no undo"],
        "shm_growth_bytes_after_100": shm_grew,
        "rss_growth_bytes_after_100": rss_grew,
        "lines": lines,
    }


@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    """vLLM's settings for the engines started inside, restored after: each engine in a
    process of its own; the bench's worker functions (the floor's reload, the undo
    record) carried by pickle; torch's thread count left to `Pinning` (vLLM ignores
    it once it has bound its threads)."""
    settings = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stage_targets(worker: Any, paths: list[str]) -> None:
    """Map the targets saved at `paths` into the engine's process (shared with the other
    engines through the page cache), for its floor to reload from memory."""
    worker._wt_bench_targets = [
        list(torch.load(path, mmap=True, weights_only=True).items()) for path in paths
    ]


def engines_pinning(llms: list[Any], engine_pids: set[int]) -> Pinning | None:
    """The pinning of `llms` (their processes: `engine_pids`), or None where there are
    none or this host cannot split its cores."""

    def set_engine_threads(n: int) -> None:
        for llm in llms:
            llm.collective_rpc(_set_threads, args=(n,))

    threads = llms[0].collective_rpc(_get_threads)[0]
    pinning = Pinning(engine_pids, set_engine_threads, threads)
    return pinning if engine_pids and pinning.can_split else None


def reload_staged(worker: Any, i: int) -> None:
    """vLLM's own reload of target `i` from the engine's memory: the floor."""
    worker.model_runner.reload_weights(weights_iterator=iter(worker._wt_bench_targets[i]))


def timed_round(
    run: Callable[[], None], llm: Any, sync: bool
) -> tuple[float, dict[str, float] | None]:
    """The seconds `run()` took and, for a wt round (`sync`), its phases: the
    trainer's in this process plus the engine's in `llm`'s own."""
    before = llm.collective_rpc(_phase_totals)[0] if sync else None
    with PhaseClock() as clock:
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
    if before is None:
        return seconds, None
    after = llm.collective_rpc(_phase_totals)[0]
    return seconds, {p: clock.seconds[p] + after[p] - before[p] for p in PHASES}


def median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median of its seconds over `rounds`."""
    return {p: statistics.median(r.get(p, 0.0) for r in rounds) for p in PHASES}


def _phase_totals(worker: Any) -> dict[str, float]:
    from weight_transfer.runtime import phases

    return {p: phases.total(p) for p in PHASES}


def _set_threads(worker: Any, n: int) -> None:
    torch.set_num_threads(n)


def _get_threads(worker: Any) -> int:
    return torch.get_num_threads()


def _greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _pulled_bytes(worker: Any) -> int:
    return int(worker.weight_transfer_engine.pulled_bytes)


def _undo_cost(worker: Any) -> dict[str, Any] | None:
    """The worker model's last undo record (`weight_transfer.vllm.snapshot.UndoCost`)."""
    import dataclasses

    from weight_transfer.vllm.snapshot import last_undo_cost

    cost = last_undo_cost(worker.model_runner.model)
    return None if cost is None else dataclasses.asdict(cost)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize
