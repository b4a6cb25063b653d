"""Sync speed of every backend, side by side with the alternatives, in one run.

`python -m wt_tools.bench` (`wt bench`, `nox -s bench`) runs `BLOCKS` in
order, each a named function that prints its tables and returns its figures
(stored under the block's key in bench.json):

- `digest`: the digest of verified bytes alone against a copy of the same
  bytes (`wt_tools.digest_bench`);
- `gather`: an FSDP2 trainer's pass over its model (`wt_tools.gather_bench`);
- `scenarios`: the transport alone into plain targets in worker processes,
  against a memcpy and a bare broadcast of the same bytes, `verify` priced
  end to end (`wt_tools.scenarios`);
- `live`: a Llama of about 1 GiB in float32 (`--layers`) in live vLLM
  engines, every backend against vLLM's own reload from memory and against
  save + reload (`wt_tools.live_bench`, which declares its rows);
- `lora`: a rank-16 LoRA adapter against saving it and vLLM's load from
  disk (`wt_tools.lora_bench`);
- `live_moe`: a tiny Qwen3-MoE synced by each backend, in a process of its
  own, its tokens checked against a fresh engine's (`wt_tools.moe_bench`).

Then the goals (`wt_tools.goals`, one definition each) are checked against
the run's figures (`wt_tools.report`). Figures are medians of interleaved
rounds; ratios are against references timed in the same run. Results go to
stdout and `--out` (JSON, Markdown, PNG). `--blocks` runs some blocks only;
`--merge` reports the blocks of several such runs together (the CI's smoke
run runs two halves at once).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from wt_tools.local_ray import set_loopback_env

set_loopback_env()  # before anything imports Ray (vLLM does)

from wt_tools.local_ray import start_local_ray  # noqa: E402
from wt_tools.tiny_model import TinyLlamaSpec  # noqa: E402


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeats: int
    layers: int
    work: str  # scratch folder (checkpoints, Ray's session)


@dataclass(frozen=True)
class Block:
    """One part of the run: `run(settings)` prints its tables and returns its figures,
    stored under `key` in bench.json."""

    key: str
    run: Callable[[Settings], Any]
    ray: bool = False  # needs the local Ray cluster (started once, before the first such block)
    live: bool = False  # starts vLLM engines (skipped by --no-live)


def digest(s: Settings) -> dict[str, Any]:
    """The digest of verified bytes alone (`wt_tools.digest_bench`)."""
    from wt_tools import digest_bench, report

    print("digest cost (verified bytes), against a copy of the same bytes:")
    result = digest_bench.measure(repeats=max(10, 5 * s.repeats))
    print("\n".join(report.digest_table(result)))
    return result


def gather(s: Settings) -> dict[str, Any]:
    """An FSDP2 trainer's pass over its model (`wt_tools.gather_bench`)."""
    from wt_tools import gather_bench

    print("an FSDP2 trainer's pass over its model, full tensors against local shards:")
    result = gather_bench.measure(
        ranks=2, layers=2 if s.quick else 8, hidden=256 if s.quick else 1024, repeats=s.repeats
    )
    print("\n".join(gather_bench.table(result)))
    return result


def scenarios(s: Settings) -> list[dict[str, Any]]:
    """The transport alone into plain targets in worker processes (`wt_tools.scenarios`)."""
    from wt_tools.scenarios import run_scenario, scenarios_for

    chosen = scenarios_for(s.quick, s.repeats)
    out = []
    for i, sc in enumerate(chosen, start=1):
        print(
            f"[{i}/{len(chosen)}] {sc.name}: {sc.nbytes / 2**20:.0f} MiB, {len(sc.layout)} tensors"
        )
        out.append(run_scenario(sc, log=lambda m: print(m, flush=True)))
    _give_back_memory()
    return out


def _give_back_memory() -> None:
    """Return the heap the scenarios freed to the system (glibc keeps it otherwise), so
    the live engines started after them find it; prints this process's resident size."""
    import ctypes
    import gc

    from wt_tools.workers import rss_bytes

    before = rss_bytes()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"bench process: {before / 2**30:.2f} GiB resident, {rss_bytes() / 2**30:.2f} GiB after")


def live(s: Settings) -> dict[str, Any]:
    """Live vLLM engines (`wt_tools.live_bench`)."""
    from wt_tools import live_bench

    return live_bench.measure(s.layers, s.repeats, s.work)


def lora(s: Settings) -> dict[str, Any]:
    """A rank-16 LoRA adapter (`wt_tools.lora_bench`): the tiny model, and in a full run
    a 4-layer hidden-1024 one."""
    from wt_tools import lora_bench
    from wt_tools.live_bench import in_fresh_process

    specs = [("tiny", TinyLlamaSpec())]
    if not s.quick:
        specs.append(("1024x4", TinyLlamaSpec.large(num_hidden_layers=4)))
    rows = [
        in_fresh_process(lora_bench.measure, *spec, max(s.repeats, 3), s.work) for spec in specs
    ]
    result = {"rank": lora_bench.RANK, "rows": rows}
    print("\na rank-16 LoRA adapter: wt's sync against saving it and vLLM's load from disk")
    print("\n".join(lora_bench.table(result)))
    return result


def live_moe(s: Settings) -> dict[str, Any]:
    """A live MoE model (`wt_tools.moe_bench`), in a process of its own."""
    from wt_tools import moe_bench
    from wt_tools.live_bench import in_fresh_process
    from wt_tools.tiny_model import TinyMoESpec

    spec = (
        TinyMoESpec(num_hidden_layers=1, moe_intermediate_size=64)
        if s.quick
        else moe_bench.MOE_SPEC
    )
    result = in_fresh_process(moe_bench.measure, s.repeats, s.work, spec)
    print(
        f"\nlive MoE ({result['tensors']} tensors, {result['experts']} experts a layer, "
        f"{result['bytes'] / 1e6:.0f} MB): each backend against vLLM's reload"
    )
    for row in result["rows"]:
        print(f"{row['method']:<34} {row['median_s']:9.3f} {row['ratio_to_floor']:8.2f}")
    print(f"wt_sharded_rdt: {result['sharded_rdt_refused']}")
    return result


# In order. The digest and the trainer's gather run first, while no Ray process
# shares the cores (it makes 2-thread timings erratic).
BLOCKS: tuple[Block, ...] = (
    Block("digest", digest),
    Block("gather", gather),
    Block("scenarios", scenarios, ray=True),
    Block("live", live, ray=True, live=True),
    Block("lora", lora, live=True),
    Block("live_moe", live_moe, live=True),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wt bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small scenarios, one round (CI)")
    parser.add_argument("--layers", type=int, default=None, help="live model layers (16 = 1 GiB)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--out", default="bench-results", help="folder for JSON, Markdown, PNG")
    parser.add_argument("--no-live", action="store_true", help="transport scenarios only")
    parser.add_argument(
        "--blocks",
        default=",".join(b.key for b in BLOCKS),
        help="the blocks to run, comma-separated (default: all); the others are not measured",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="no run: report the blocks of earlier runs' DIR/bench.json together (each block "
        "from the first run that measured it) into --out",
    )
    parser.add_argument(
        "--model-cluster",
        action="store_true",
        help="only the cost model's cluster predictions, calibrated from OUT/bench.json",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from wt_tools import cost_model, report

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    if args.model_cluster:
        calibration = cost_model.calibrate(report.load(json_path))
        print(report.cluster_table(cost_model.predict(calibration), calibration))
        return 0
    if args.merge:
        write_report(merged([os.path.join(d, "bench.json") for d in args.merge]), args.out)
        return 0
    chosen = set(args.blocks.split(","))
    unknown = chosen - {b.key for b in BLOCKS}
    if unknown:
        known = ", ".join(b.key for b in BLOCKS)
        parser.error(f"--blocks: no block {', '.join(sorted(unknown))} (the blocks: {known})")
    work = tempfile.mkdtemp(prefix="wt-bench-")
    atexit.register(shutil.rmtree, work, True)  # the checkpoints are scratch
    settings = Settings(
        quick=args.quick,
        repeats=args.repeats or (1 if args.quick else 3),
        layers=args.layers or (2 if args.quick else 16),
        work=work,
    )
    results: dict[str, Any] = {"quick": settings.quick, "repeats": settings.repeats}
    ray_started = False
    for block in BLOCKS:
        if block.key not in chosen or (block.live and args.no_live):
            results[block.key] = None
            continue
        if block.ray and not ray_started:
            start_local_ray(work)
            ray_started = True
        results[block.key] = block.run(settings)
    write_report(results, args.out)
    return 0


def merged(paths: list[str]) -> dict[str, Any]:
    """One run's results from several `bench.json`: each block from the first that
    measured it. Runs of different settings (`quick`, `repeats`) are refused."""
    from wt_tools import report

    runs = []
    for path in paths:
        run = report.load(path)
        if run is None:
            raise SystemExit(f"wt bench --merge: no {path}")
        runs.append(run)
    settings = {(run["quick"], run["repeats"]) for run in runs}
    if len(settings) > 1:
        raise SystemExit(
            f"wt bench --merge: runs of different settings (quick, repeats): {settings}"
        )
    results: dict[str, Any] = {"quick": runs[0]["quick"], "repeats": runs[0]["repeats"]}
    for block in BLOCKS:
        results[block.key] = next((r[block.key] for r in runs if r.get(block.key)), None)
    return results


def write_report(results: dict[str, Any], out: str) -> None:
    """The cost model and the goals of `results`, then `out`/bench.json, bench.md and
    the plots; the summary is printed."""
    from wt_tools import cost_model, report

    calibration = cost_model.calibrate(results)
    results["cost_model"] = {
        "calibration": calibration,
        "predictions": cost_model.predict(calibration),
    }
    results["targets"] = report.targets(results)
    json_path = os.path.join(out, "bench.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    markdown = report.markdown(results)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown)
    plots = report.plots(results, out)
    print("\n" + markdown)
    print(f"written: {json_path}, {os.path.join(out, 'bench.md')}, " + ", ".join(plots))


if __name__ == "__main__":
    raise SystemExit(main())
