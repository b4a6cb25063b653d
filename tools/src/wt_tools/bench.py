"""Sync speed into a live vLLM, side by side with the alternatives, in one run.

`python -m wt_tools.bench` (also `nox -s bench`) builds a Llama of
about 1 GiB in float32 (hidden 1024, 16 layers; `--layers` changes the size),
starts vLLM on it in-process, and times, interleaved over `--repeats` rounds:

- floor: vLLM's own reload of the same tensors from memory
  (`model_runner.reload_weights(weights_iterator=...)`): no transport at all;
- wt_nccl, packed (the default wire parameters) and unpacked: a trainer in
  this process pushing a `ModuleSource` through `LocalVLLMWeightSyncClient`;
  packed also with `check_finite=False`, which prices the non-finite check;
- save + reload: write a safetensors checkpoint, then `reload_weights` from it
  (what users do without a sync library);
- wt_ipc, packed (default staging, 2 x 256 MiB, and staging about the
  model's size, 16 buffers) and unpacked, into a second engine (backend
  `wt_ipc`) with its own floor and save + reload: colocated, the bytes go
  through shared memory instead of a socket;
- wt_sharded_rdt over NIXL (a local Ray cluster on 127.0.0.1; the producer
  is a Ray actor, the engine's worker pulls its slices) into a third engine,
  with its own floor; and, for tensor-parallel engines of 1, 2 and 4 workers
  (a sharded MLP stack, `wt_tools.sharded_bench`), the bytes each worker
  pulls against the model's size (a broadcast sends every worker all of it);
- ipc transport alone: the same tensors into a plain module of the same
  shapes (no vLLM), against a one-thread memcpy of the same bytes; then 100
  more syncs, after which /dev/shm usage and this process's RSS are compared
  with their values after the first.

Every wt row also reports where its time goes (`weight_transfer.runtime.phases`:
check, pack, wire, unpack, undo record, load; seconds and share of the round) and
its engine's undo record (`WT_VLLM_SNAPSHOT`, the default
`host`): the seconds it took and the bytes it copied and kept alive by reference until
the round ended, beside the model's size.

Then, in a process of its own, a live MoE model (`wt_tools.moe_bench`: a tiny
Qwen3-MoE of 64 experts a layer, 3,219 tensors) synced by wt_nccl and wt_ipc
against vLLM's reload of the same tensors, its tokens checked against a
fresh engine's; wt_sharded_rdt's refusal of it is reported.

Each round loads alternating weights, so every load really changes the model;
after the last round the served tokens are checked against the trainer's
weights. Figures are medians; ratios are against the floor of the same run.
Before all of it (before Ray starts), the digest of verified bytes alone
(`wt_tools.digest_bench`): seconds per GiB for a dense bucket and one of
4,000 small tensors, at 1 and 2 threads, against a copy of the same bytes;
the transport scenarios (`wt_tools.scenarios`) price `verify` end to end.
Results go to stdout and `--out` (JSON).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from wt_tools.local_ray import set_loopback_env

set_loopback_env()  # before anything imports Ray (vLLM does)

import torch  # noqa: E402

from weight_transfer.runtime.phases import PHASES, PhaseClock  # noqa: E402
from wt_tools.local_ray import start_local_ray  # noqa: E402
from wt_tools.tiny_model import TinyLlamaSpec, build_tiny_llama, tiny_llama  # noqa: E402


def _greedy(llm: Any, prompt: str) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def live(layers: int, repeats: int, work: str) -> dict[str, Any]:
    """The live-engine blocks (see the module docstring); every figure in a dict."""
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer import LocalVLLMWeightSyncClient, ModuleSource
    from weight_transfer.factory import WeightTransferTrainerFactory
    from wt_ipc import IPCTrainerInitInfo
    from wt_kits.group.stateless import free_port
    from wt_nccl import NCCLTrainerInitInfo
    from wt_sharded_rdt import ShardedRDTTrainerInitInfo
    from wt_tools.sharded_bench import measure

    spec = TinyLlamaSpec.large(num_hidden_layers=layers)
    served_dir = build_tiny_llama(os.path.join(work, "served"), seed=0, spec=spec)
    targets = [tiny_llama(spec, seed=s) for s in (1, 2)]
    nbytes = sum(p.numel() * p.element_size() for p in targets[0].parameters())
    print(f"live engines: {layers} layers, {nbytes / 2**30:.2f} GiB float32; repeats {repeats}")

    cuda = torch.cuda.is_available()
    extra: dict[str, Any] = {} if cuda else {"kv_cache_memory_bytes": 256 << 20}
    llms = {
        backend: LLM(
            model=served_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            distributed_executor_backend="uni",
            weight_transfer_config=WeightTransferConfig(backend=f"wt_{backend}"),
            **extra,
        )
        for backend in ("nccl", "ipc", "sharded_rdt")
    }
    clients = {backend: LocalVLLMWeightSyncClient(llm) for backend, llm in llms.items()}
    sources = [ModuleSource(m) for m in targets]
    device = "cuda" if cuda else "cpu"

    connected: dict[str, tuple[dict[str, Any], Any]] = {}

    def connect(backend: str, wire: dict[str, Any]) -> Any:
        """`backend`'s trainer engine for `wire`; re-runs trainer_init (untimed) on a change."""
        if backend in connected and connected[backend][0] == wire:
            return connected[backend][1]
        if backend in connected:
            connected[backend][1].shutdown()
        info: Any
        if backend == "nccl":
            info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, device=device, **wire)
        elif backend == "sharded_rdt":
            info = ShardedRDTTrainerInitInfo(
                rank=0, num_consumers=1, producer_prefix=f"wt-bench-{free_port()}", **wire
            )
        else:
            info = IPCTrainerInitInfo(rank=0, device=device, **wire)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=clients[backend], source=sources[0]
        )
        connected[backend] = (wire, engine)
        return engine

    ckpt = os.path.join(work, "ckpt")

    def floor(backend: str) -> Callable[[int], Callable[[], None]]:
        def prepare(i: int) -> Callable[[], None]:
            weights = [(n, p.detach()) for n, p in targets[i].named_parameters()]

            def reload(worker: Any) -> None:
                worker.model_runner.reload_weights(weights_iterator=iter(weights))

            return lambda: llms[backend].collective_rpc(reload)

        return prepare

    def sync_with(
        backend: str, wire: dict[str, Any], *, check_finite: bool = True
    ) -> Callable[[int], Callable[[], None]]:
        def prepare(i: int) -> Callable[[], None]:
            engine = connect(backend, wire)
            engine.source = sources[i]
            engine.check_finite = check_finite
            return engine.send_weights

        return prepare

    def save_and_reload(backend: str) -> Callable[[int], Callable[[], None]]:
        def prepare(i: int) -> Callable[[], None]:
            def run() -> None:
                os.makedirs(ckpt, exist_ok=True)
                state = {n: p.detach().contiguous() for n, p in targets[i].named_parameters()}
                save_file(state, os.path.join(ckpt, "model.safetensors"))
                llms[backend].collective_rpc(
                    "reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True}
                )

            return run

        return prepare

    # Staging about the model's size (16 buffers): the trainer writes ahead and is
    # done before the load needs the cores it shares with it.
    model_sized = {
        "packed_num_buffers": 16,
        "packed_buffer_size_bytes": -(-nbytes // (15 << 20)) << 20,
    }

    # Per block: name -> prepare(i) (untimed) returning the timed call. One
    # trainer engine at a time holds a worker's channel, so each wire variant
    # is timed in its own block (its engine and staging reused across rounds),
    # interleaved with that engine's floor (and save + reload); the first entry
    # of a block is its floor.
    blocks: list[dict[str, Callable[[int], Callable[[], None]]]] = [
        {
            "floor: vLLM reload from memory": floor("nccl"),
            "wt_nccl packed": sync_with("nccl", {}),
            "wt_nccl packed, no finite check": sync_with("nccl", {}, check_finite=False),
            "save + reload_weights": save_and_reload("nccl"),
        },
        {
            "floor (unpacked block)": floor("nccl"),
            "wt_nccl unpacked": sync_with("nccl", {"packed": False}),
        },
        {
            "floor (ipc engine)": floor("ipc"),
            "wt_ipc packed": sync_with("ipc", {}),
            "wt_ipc packed, no finite check": sync_with("ipc", {}, check_finite=False),
            "save + reload (ipc engine)": save_and_reload("ipc"),
        },
        {
            "floor (ipc staging block)": floor("ipc"),
            "wt_ipc packed, staging ~ model": sync_with("ipc", model_sized),
        },
        {
            "floor (ipc unpacked block)": floor("ipc"),
            "wt_ipc unpacked": sync_with("ipc", {"packed": False}),
        },
        {
            "floor (sharded_rdt engine)": floor("sharded_rdt"),
            "wt_sharded_rdt (nixl)": sync_with("sharded_rdt", {}),
        },
    ]
    times: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, float]]] = {}  # per wt row, per round: seconds per phase
    floor_of: dict[str, str] = {}
    for block in blocks:
        block_floor = next(iter(block))
        for name, prepare in block.items():  # warm-up: first touches, allocator growth
            floor_of[name] = block_floor
            prepare(1)()
        for r in range(repeats):
            for name, prepare in block.items():
                run = prepare(r % 2)
                with PhaseClock() as clock:
                    t0 = time.perf_counter()
                    run()
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                if name.startswith("wt_"):
                    phases.setdefault(name, []).append(clock.seconds)

    # Correctness: what each engine serves now equals a sync of the same target.
    last = (repeats - 1) % 2
    prompt = "w1 w2 w3 w4"
    for backend, llm in llms.items():
        floor(backend)(last)()
        after_reload = _greedy(llm, prompt)
        sync_with(backend, {})(1 - last)()
        sync_with(backend, {})(last)()
        if _greedy(llm, prompt) != after_reload:
            raise RuntimeError(f"tokens after wt_{backend} differ from tokens after vLLM's reload")

    pulled = llms["sharded_rdt"].collective_rpc(_pulled_bytes)[0]
    # The undo record of each engine's last wt round (every wt row of an engine keeps the same).
    undo = {backend: llm.collective_rpc(_undo_cost)[0] for backend, llm in llms.items()}
    engine_of = {"wt_nccl": "nccl", "wt_ipc": "ipc", "wt_sharded_rdt": "sharded_rdt"}
    rows: list[dict[str, Any]] = []
    print(
        f"\n{'method':<34} {'median s':>9} {'GB/s':>7} {'x floor':>8} {'MB/worker':>10} "
        f"{'undo s':>7} {'undo MB copied/kept':>20}"
    )
    for name, ts in times.items():
        base = statistics.median(times[floor_of[name]])
        med = statistics.median(ts)
        per_worker = pulled if name.startswith("wt_sharded_rdt") else nbytes
        moved = f"{per_worker / 1e6:10.1f}" if name.startswith("wt_") else f"{'-':>10}"
        cost = undo.get(engine_of.get(name.split(" ")[0], ""))
        rows.append(
            {
                "method": name,
                "median_s": med,
                "times_s": ts,
                "ratio_to_floor": med / base,
                "bytes_per_worker": per_worker if name.startswith("wt_") else None,
                "undo": cost if name.startswith("wt_") else None,
                "phases_s": _median_phases(phases[name]) if name in phases else None,
            }
        )
        kept = ""
        if cost and name.startswith("wt_"):
            copied, held = cost["copied_bytes"] / 1e6, cost["kept_bytes"] / 1e6
            kept = f"{cost['seconds']:7.3f} {copied:9.1f}/{held:<10.1f}"
        print(f"{name:<34} {med:9.3f} {nbytes / 1e9 / med:7.2f} {med / base:8.2f} {moved} {kept}")
    print(
        "\nwhere a round's time goes (seconds summed over threads, so shares may add past 1; "
        "wire: the trainer waiting on its sends):"
    )
    print(f"{'method':<34} " + " ".join(f"{p:>13}" for p in PHASES))
    for row in rows:
        seconds = row["phases_s"]
        if seconds:
            shares = [f"{seconds[p]:6.3f} {seconds[p] / row['median_s']:5.0%}" for p in PHASES]
            print(f"{row['method']:<34} " + " ".join(f"{s:>13}" for s in shares))
    for _, engine in connected.values():
        engine.shutdown()
    sharded = [measure(tp, layers=2 if layers <= 2 else 8, repeats=repeats) for tp in (1, 2, 4)]
    print("\nsharded_rdt, tensor-parallel engines (sharded MLP stack, loopback transport):")
    print(f"{'workers':>7} {'model MB':>9} {'MB per worker':>14} {'share':>6} {'sync s':>7}")
    for row in sharded:
        per = max(row["bytes_per_worker"])
        print(
            f"{row['tp']:>7} {row['model_bytes'] / 1e6:9.1f} {per / 1e6:14.1f} "
            f"{per / row['model_bytes']:6.2f} {row['seconds']:7.3f}"
        )
    transport = _in_fresh_process(_ipc_transport, spec, repeats)
    print()
    for line in transport.pop("lines"):
        print(line)
    ipc = statistics.median(times["wt_ipc packed"])
    ipc_floor = statistics.median(times["floor (ipc engine)"])
    staged_floor = statistics.median(times["floor (ipc staging block)"])
    ipc_ratio, speedup = (
        ipc / ipc_floor,
        statistics.median(times["save + reload (ipc engine)"]) / ipc,
    )
    print(
        f"wt_ipc packed: {ipc_ratio:.2f}x its floor (goal <= 1.15x), {speedup:.2f}x faster "
        f"than save + reload (goal >= 2.5x). Where the time goes: vLLM's load (the floor) "
        f"{ipc_floor:.3f} s; the transfer alone {transport['transport_no_undo_s']:.3f} s; the sync "
        f"adds {ipc - ipc_floor:+.3f} s to the floor: the part of the transfer (the trainer's copy "
        "into staging, and the finite check where on) not hidden behind the load, which shares "
        "the same cores and memory bus. With staging about the model's size the trainer is done "
        "writing before the load needs the cores: "
        f"{statistics.median(times['wt_ipc packed, staging ~ model']) / staged_floor:.2f}x "
        "the floor"
    )
    return {
        "bytes": nbytes,
        "layers": layers,
        "repeats": repeats,
        "rows": rows,
        "ipc": {"ratio_to_floor": ipc_ratio, "speedup_over_save_reload": speedup, **transport},
        "bytes_per_worker": {"nccl": nbytes, "ipc": nbytes, "sharded_rdt": pulled},
        "sharded_rdt_tp": sharded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wt bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small scenarios, one round (CI)")
    parser.add_argument("--layers", type=int, default=None, help="live model layers (16 = 1 GiB)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--out", default="bench-results", help="folder for JSON, Markdown, PNG")
    parser.add_argument("--no-live", action="store_true", help="transport scenarios only")
    parser.add_argument(
        "--model-cluster",
        action="store_true",
        help="only the cost model's cluster predictions, calibrated from OUT/bench.json",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from wt_tools import cost_model, digest_bench, gather_bench, report
    from wt_tools.scenarios import run_scenario, scenarios_for

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    if args.model_cluster:
        calibration = cost_model.calibrate(report.load(json_path))
        print(report.cluster_table(cost_model.predict(calibration), calibration))
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    layers = args.layers or (2 if args.quick else 16)
    results: dict[str, Any] = {"quick": args.quick, "repeats": repeats, "scenarios": []}
    # first, while no Ray process shares the cores (it makes 2-thread timings erratic)
    print("digest cost (verified bytes), against a copy of the same bytes:")
    results["digest"] = digest_bench.measure(repeats=max(10, 5 * repeats))
    print("\n".join(report.digest_table(results["digest"])))
    print("an FSDP2 trainer's pass over its model, full tensors against local shards:")
    results["gather"] = gather_bench.measure(
        ranks=2, layers=2 if args.quick else 8, hidden=256 if args.quick else 1024, repeats=repeats
    )
    print("\n".join(gather_bench.table(results["gather"])))
    work = tempfile.mkdtemp(prefix="wt-bench-")
    atexit.register(shutil.rmtree, work, True)  # the checkpoints are scratch
    start_local_ray(work)
    chosen = scenarios_for(args.quick, repeats)
    for i, sc in enumerate(chosen, start=1):
        print(
            f"[{i}/{len(chosen)}] {sc.name}: {sc.nbytes / 2**20:.0f} MiB, {len(sc.layout)} tensors"
        )
        results["scenarios"].append(run_scenario(sc, log=lambda m: print(m, flush=True)))
    results["live"] = None if args.no_live else live(layers, repeats, work)
    results["lora"] = None if args.no_live else lora(args.quick, repeats, work)
    results["live_moe"] = None if args.no_live else live_moe(args.quick, repeats, work)
    calibration = cost_model.calibrate(results)
    results["cost_model"] = {
        "calibration": calibration,
        "predictions": cost_model.predict(calibration),
    }
    results["targets"] = report.targets(results)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    markdown = report.markdown(results)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown)
    plots = report.plots(results, args.out)
    print("\n" + markdown)
    print(f"written: {json_path}, {os.path.join(args.out, 'bench.md')}, " + ", ".join(plots))
    return 0


def lora(quick: bool, repeats: int, work: str) -> dict[str, Any]:
    """The LoRA adapter block (`wt_tools.lora_bench`): the tiny model, and in a full
    run a 4-layer hidden-1024 one; printed."""
    from wt_tools import lora_bench

    specs = [("tiny", TinyLlamaSpec())]
    if not quick:
        specs.append(("1024x4", TinyLlamaSpec.large(num_hidden_layers=4)))
    rows = [_in_fresh_process(lora_bench.measure, *spec, max(repeats, 3), work) for spec in specs]
    result = {"rank": lora_bench.RANK, "rows": rows}
    print("\na rank-16 LoRA adapter: wt's sync against saving it and vLLM's load from disk")
    print("\n".join(lora_bench.table(result)))
    return result


def live_moe(quick: bool, repeats: int, work: str) -> dict[str, Any]:
    """The live MoE block (`wt_tools.moe_bench`), in a process of its own; printed."""
    from wt_tools import moe_bench
    from wt_tools.tiny_model import TinyMoESpec

    spec = (
        TinyMoESpec(num_hidden_layers=1, moe_intermediate_size=64) if quick else moe_bench.MOE_SPEC
    )
    result = _in_fresh_process(moe_bench.measure, repeats, work, spec)
    print(
        f"\nlive MoE ({result['tensors']} tensors, {result['experts']} experts a layer, "
        f"{result['bytes'] / 1e6:.0f} MB): each backend against vLLM's reload"
    )
    for row in result["rows"]:
        print(f"{row['method']:<34} {row['median_s']:9.3f} {row['ratio_to_floor']:8.2f}")
    print(f"wt_sharded_rdt: {result['sharded_rdt_refused']}")
    return result


def _pulled_bytes(worker: Any) -> int:
    return int(worker.weight_transfer_engine.pulled_bytes)


def _median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median of its seconds over `rounds`."""
    return {p: statistics.median(r.get(p, 0.0) for r in rounds) for p in PHASES}


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


def _in_fresh_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a spawned interpreter: vLLM pins this process's threads."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def _ipc_transport(spec: TinyLlamaSpec, repeats: int) -> dict[str, Any]:
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

    lines = [
        f"one-thread memcpy of the same bytes: {rate(med['memcpy'])}",
        f"ipc transport, no vLLM, loader without undo: {rate(med['no undo'])}, "
        f"{med['memcpy'] / med['no undo']:.0%} of the memcpy (goal >= 70%)",
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


if __name__ == "__main__":
    raise SystemExit(main())
