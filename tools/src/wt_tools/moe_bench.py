"""A live MoE model synced by each backend, against vLLM's own reload of it.

`measure(repeats, work)` builds a tiny Qwen3-MoE (`MoESpec`: 64 experts a
layer, a few thousand tensors; vLLM's CPU kernel prepacks its fused experts),
starts one vLLM engine per backend, each in a process of its own, and times,
interleaved over `repeats` rounds of alternating weights:

- floor: vLLM's reload of the same tensors from the engine's memory
  (`model_runner.reload_weights(weights_iterator=...)`). It is the time to
  beat, not a correct result: on CPU that layerwise reload leaves the fused
  experts wrong (`weight_transfer.vllm.moe`);
- wt_nccl packed and wt_ipc packed: a trainer in this process pushing the
  target's tensors through `LocalVLLMWeightSyncClient`, each into its engine.

Each pair twice: trainer and engines on every core (`shared`), and on
disjoint cores as deployments run (`wt_tools.pinning`), where this host has
at least two. A wt row records where its time went (`phases_s`: the trainer's
phases plus the engine's, `live_bench.timed_round`).

wt_sharded_rdt refuses such a model at `trainer_init` (a recorded slice replay
cannot redo the prepack); its row holds the refusal. After the last round each
engine's greedy tokens must equal a fresh engine's of the last target, so a
row is timed only if its syncs are exact. Each engine runs in a process of its
own (`live_bench.engine_environment`), which the pinning needs; run
`measure` in a process of its own too (`live_bench.in_fresh_process`).
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from wt_tools.pinning import Cores, engine_processes
from wt_tools.tiny_model import ENGINE_KWARGS, TinyMoESpec, build_tiny_moe

__all__ = ["MOE_SPEC", "measure"]

# 16 layers of 64 experts: 3,219 tensors, 0.11 GB in float32
MOE_SPEC = TinyMoESpec(num_hidden_layers=16, num_experts=64, moe_intermediate_size=64)
PROMPT = "w1 w2 w3 w4"


@dataclass
class _Engine:
    backend: str
    llm: Any
    trainer: Any = None


def _greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _trainer(backend: str, llm: Any, source: Any) -> Any:
    from weight_transfer import LocalVLLMWeightSyncClient, WeightTransferTrainerFactory
    from wt_kits.group.stateless import free_port

    info: Any
    if backend == "nccl":
        from wt_nccl import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, device="cpu")
    elif backend == "ipc":
        from wt_ipc import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0, device="cpu")
    else:
        from wt_sharded_rdt import ShardedRDTTrainerInitInfo

        info = ShardedRDTTrainerInitInfo(
            rank=0, num_consumers=1, transport="loopback", producer_prefix=f"wt-moe-{free_port()}"
        )
    return WeightTransferTrainerFactory.trainer_init(
        info, client=LocalVLLMWeightSyncClient(llm), source=source
    )


def measure(repeats: int, work: str, spec: TinyMoESpec = MOE_SPEC) -> dict[str, Any]:
    """See the module docstring; every figure in a JSON-safe dict."""
    from wt_tools.live_bench import engine_environment

    with engine_environment():
        return _measure(repeats, work, spec)  # its engines are shut down before it returns


def _measure(repeats: int, work: str, spec: TinyMoESpec) -> dict[str, Any]:
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from wt_tools.live_bench import engines_pinning, median_phases, reload_staged, timed_round
    from wt_tools.scenarios import TensorSource

    served = build_tiny_moe(os.path.join(work, "moe-served"), seed=0, spec=spec)
    dirs = [build_tiny_moe(os.path.join(work, f"moe-{s}"), seed=s, spec=spec) for s in (1, 2)]
    # checkpoint format, as a trainer sends it: one tensor per expert and projection
    targets = [load_file(os.path.join(d, "model.safetensors")) for d in dirs]
    nbytes = sum(t.numel() * t.element_size() for t in targets[0].values())

    def engine_of(backend: str) -> Any:
        config = WeightTransferConfig(backend=f"wt_{backend}")
        return LLM(model=served, weight_transfer_config=config, **ENGINE_KWARGS)

    engines: list[_Engine] = []
    engine_pids: set[int] = set()
    for backend in ("nccl", "ipc"):
        llm, pids = engine_processes(functools.partial(engine_of, backend))
        llm.collective_rpc(_stage_targets, args=(dirs,))  # the floor's tensors, in its memory
        engines.append(_Engine(backend, llm))
        engine_pids |= pids
    source = TensorSource(targets[0])
    for engine in engines:
        engine.trainer = _trainer(engine.backend, engine.llm, source)
    pinning = engines_pinning([e.llm for e in engines], engine_pids)

    def floor(engine: _Engine, i: int) -> Callable[[], None]:
        return lambda: engine.llm.collective_rpc(reload_staged, args=(i,))

    def sync(engine: _Engine, i: int) -> Callable[[], None]:
        def run() -> None:
            source.tensors = targets[i]
            engine.trainer.send_weights()

        return run

    placements: tuple[Cores, ...] = ("shared", "disjoint") if pinning else ("shared",)
    times: dict[tuple[str, Cores, str], list[float]] = {}
    phases: dict[tuple[str, Cores], list[dict[str, float]]] = {}
    for cores in placements:
        if pinning is not None:
            pinning.apply(cores)
        for engine in engines:
            rows = {"floor": floor, "packed": sync}
            for prepare in rows.values():  # warm-up
                prepare(engine, 1)()
            for r in range(repeats):
                for kind, prepare in rows.items():
                    run = prepare(engine, r % 2)
                    seconds, split = timed_round(run, engine.llm, kind == "packed")
                    times.setdefault((engine.backend, cores, kind), []).append(seconds)
                    if split is not None:
                        phases.setdefault((engine.backend, cores), []).append(split)
    if pinning is not None:
        pinning.apply("shared")
    last = (repeats - 1) % 2
    for engine in engines:  # a wt round last: the engine serves exactly the target
        sync(engine, 1 - last)()
        sync(engine, last)()
        engine.trainer.shutdown()
    fresh = LLM(model=dirs[last], **ENGINE_KWARGS)
    want = _greedy(fresh)
    exact = {e.backend: _greedy(e.llm) == want for e in engines}
    for llm in [fresh, *(e.llm for e in engines)]:  # a process ends once its engines have
        llm.llm_engine.engine_core.shutdown()
    refused = _sharded_rdt_refusal(engine_of, source)
    rows_out = []
    for cores in placements:
        suffix = "" if cores == "shared" else "_disjoint"
        where = "" if cores == "shared" else ", disjoint cores"
        for engine in engines:
            b = engine.backend
            base = statistics.median(times[(b, cores, "floor")])
            for kind, method in (
                ("floor", f"floor: vLLM reload ({b} engine){where}"),
                ("packed", f"wt_{b} packed{where}"),
            ):
                med = statistics.median(times[(b, cores, kind)])
                rows_out.append(
                    {
                        "id": f"floor.{b}{suffix}" if kind == "floor" else f"{b}.packed{suffix}",
                        "method": method,
                        "cores": cores,
                        "median_s": med,
                        "times_s": times[(b, cores, kind)],
                        "ratio_to_floor": med / base,
                        "tokens_equal_fresh": exact[b] if kind == "packed" else None,
                        "phases_s": (
                            median_phases(phases[(b, cores)]) if kind == "packed" else None
                        ),
                    }
                )
    if not all(exact.values()):
        raise RuntimeError(f"live MoE: tokens after a sync differ from a fresh engine's: {exact}")
    return {
        "tensors": len(targets[0]),
        "bytes": nbytes,
        "experts": spec.num_experts,
        "layers": spec.num_hidden_layers,
        "repeats": repeats,
        "rows": rows_out,
        "sharded_rdt_refused": refused,
        "threads": torch.get_num_threads(),
    }


def _sharded_rdt_refusal(engine_of: Callable[[str], Any], source: Any) -> str | None:
    """wt_sharded_rdt's refusal of the model at init, or None. Its loopback transport
    needs the engine in this process; that engine comes last, as vLLM's in-process
    engines share process-wide parallel groups and cache vLLM's settings."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sharded = engine_of("sharded_rdt")
    try:
        _trainer("sharded_rdt", sharded, source).shutdown()
    except Exception as error:  # the expected refusal
        return f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        sharded.llm_engine.engine_core.shutdown()
    return None


def _stage_targets(worker: Any, dirs: list[str]) -> None:
    from safetensors.torch import load_file

    worker._wt_bench_targets = [
        list(load_file(os.path.join(d, "model.safetensors")).items()) for d in dirs
    ]
