"""A live MoE model synced by each backend, against vLLM's own reload of it.

`measure(repeats, work)` builds a tiny Qwen3-MoE (`MoESpec`: 64 experts a
layer, a few thousand tensors; vLLM's CPU kernel prepacks its fused experts),
starts one vLLM engine per backend in this process and times, interleaved
over `repeats` rounds of alternating weights:

- floor: vLLM's reload of the same tensors from memory
  (`model_runner.reload_weights(weights_iterator=...)`). It is the time to
  beat, not a correct result: on CPU that layerwise reload leaves the fused
  experts wrong (`weight_transfer.vllm.moe`);
- wt_nccl packed and wt_ipc packed: a trainer in this process pushing the
  target's tensors through `LocalVLLMWeightSyncClient`, each into its engine.

wt_sharded_rdt refuses such a model at `trainer_init` (a recorded slice replay
cannot redo the prepack); its row holds the refusal. After the last round each
engine's greedy tokens must equal a fresh engine's of the last target, so a
row is timed only if its syncs are exact. Run it in a process of its own
(vLLM's in-process engines share process-wide parallel groups, and a MoE
model needs an expert-parallel group an earlier dense engine never made).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

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
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from wt_tools.scenarios import TensorSource

    served = build_tiny_moe(os.path.join(work, "moe-served"), seed=0, spec=spec)
    dirs = [build_tiny_moe(os.path.join(work, f"moe-{s}"), seed=s, spec=spec) for s in (1, 2)]
    # checkpoint format, as a trainer sends it: one tensor per expert and projection
    targets = [load_file(os.path.join(d, "model.safetensors")) for d in dirs]
    nbytes = sum(t.numel() * t.element_size() for t in targets[0].values())

    def engine_of(backend: str) -> Any:
        config = WeightTransferConfig(backend=f"wt_{backend}")
        return LLM(model=served, weight_transfer_config=config, **ENGINE_KWARGS)

    engines = [_Engine(b, engine_of(b)) for b in ("nccl", "ipc")]
    source = TensorSource(targets[0])
    for engine in engines:
        engine.trainer = _trainer(engine.backend, engine.llm, source)
    refused = None
    sharded = engine_of("sharded_rdt")
    try:
        _trainer("sharded_rdt", sharded, source).shutdown()
    except Exception as error:  # the expected refusal
        refused = f"{type(error).__name__}: {str(error)[:200]}"

    def floor(engine: _Engine, i: int) -> Callable[[], None]:
        weights = list(targets[i].items())

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        return lambda: engine.llm.collective_rpc(reload)

    def sync(engine: _Engine, i: int) -> Callable[[], None]:
        def run() -> None:
            source.tensors = targets[i]
            engine.trainer.send_weights()

        return run

    times: dict[str, list[float]] = {}
    for engine in engines:
        rows = {
            f"floor: vLLM reload ({engine.backend} engine)": floor,
            f"wt_{engine.backend} packed": sync,
        }
        for prepare in rows.values():  # warm-up
            prepare(engine, 1)()
        for r in range(repeats):
            for name, prepare in rows.items():
                run = prepare(engine, r % 2)
                t0 = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - t0)
    last = (repeats - 1) % 2
    for engine in engines:  # a wt round last: the engine serves exactly the target
        sync(engine, 1 - last)()
        sync(engine, last)()
        engine.trainer.shutdown()
    fresh = LLM(model=dirs[last], **ENGINE_KWARGS)
    want = _greedy(fresh)
    exact = {e.backend: _greedy(e.llm) == want for e in engines}
    rows_out = []
    for engine in engines:
        floor_name = f"floor: vLLM reload ({engine.backend} engine)"
        base = statistics.median(times[floor_name])
        ids = (f"floor.{engine.backend}", f"{engine.backend}.packed")
        for row_id, name in zip(ids, (floor_name, f"wt_{engine.backend} packed"), strict=True):
            med = statistics.median(times[name])
            rows_out.append(
                {
                    "id": row_id,
                    "method": name,
                    "median_s": med,
                    "times_s": times[name],
                    "ratio_to_floor": med / base,
                    "tokens_equal_fresh": exact[engine.backend] if name.startswith("wt_") else None,
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
