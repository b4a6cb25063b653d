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
  (what users do without a sync library).

Each round loads alternating weights, so every load really changes the model;
after the last round the served tokens are checked against the trainer's
weights. Figures are medians; ratios are against the floor of the same run.
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

import torch

from wt_tools.tiny_model import TinyLlamaSpec, build_tiny_llama, tiny_llama


def _greedy(llm: Any, prompt: str) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wt bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16 = ~1 GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-results/bench.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer import LocalVLLMWeightSyncClient, ModuleSource
    from weight_transfer.factory import WeightTransferTrainerFactory
    from weight_transfer.transport.group import free_port
    from wt_nccl import NCCLTrainerInitInfo

    spec = TinyLlamaSpec.large(num_hidden_layers=args.layers)
    work = tempfile.mkdtemp(prefix="wt-bench-")
    atexit.register(shutil.rmtree, work, True)  # the checkpoints are scratch
    served_dir = build_tiny_llama(os.path.join(work, "served"), seed=0, spec=spec)
    targets = [tiny_llama(spec, seed=s) for s in (1, 2)]
    nbytes = sum(p.numel() * p.element_size() for p in targets[0].parameters())
    print(f"model: {args.layers} layers, {nbytes / 2**30:.2f} GiB float32; repeats {args.repeats}")

    cuda = torch.cuda.is_available()
    extra: dict[str, Any] = {} if cuda else {"kv_cache_memory_bytes": 256 << 20}
    llm = LLM(
        model=served_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        distributed_executor_backend="uni",
        weight_transfer_config=WeightTransferConfig(backend="wt_nccl"),
        **extra,
    )
    client = LocalVLLMWeightSyncClient(llm)
    sources = [ModuleSource(m) for m in targets]

    connected: dict[str, Any] = {"wire": None, "engine": None}

    def connect(wire: dict[str, Any]) -> Any:
        """The trainer engine for `wire`; re-runs trainer_init (untimed) when it changes."""
        if connected["wire"] != wire:
            if connected["engine"] is not None:
                connected["engine"].shutdown()
            info = NCCLTrainerInitInfo(
                "127.0.0.1", free_port(), 2, rank=0, device="cuda" if cuda else "cpu", **wire
            )
            connected["engine"] = WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=sources[0]
            )
            connected["wire"] = wire
        return connected["engine"]

    ckpt = os.path.join(work, "ckpt")

    def floor(i: int) -> Callable[[], None]:
        weights = [(n, p.detach()) for n, p in targets[i].named_parameters()]

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(weights))

        def run() -> None:
            llm.collective_rpc(reload)

        return run

    def sync_with(
        wire: dict[str, Any], *, check_finite: bool = True
    ) -> Callable[[int], Callable[[], None]]:
        def prepare(i: int) -> Callable[[], None]:
            engine = connect(wire)
            engine.source = sources[i]
            engine.check_finite = check_finite
            return engine.send_weights

        return prepare

    def save_and_reload(i: int) -> Callable[[], None]:
        def run() -> None:
            os.makedirs(ckpt, exist_ok=True)
            state = {n: p.detach().contiguous() for n, p in targets[i].named_parameters()}
            save_file(state, os.path.join(ckpt, "model.safetensors"))
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True}
            )

        return run

    # name -> prepare(i) (untimed) returning the timed call. One engine at a time
    # holds the worker's channel, so each wt variant is timed in its own block,
    # interleaved with the floor (and save + reload) of that block.
    blocks: list[dict[str, Callable[[int], Callable[[], None]]]] = [
        {
            "floor: vLLM reload from memory": floor,
            "wt_nccl packed": sync_with({}),
            "wt_nccl packed, no finite check": sync_with({}, check_finite=False),
            "save + reload_weights": save_and_reload,
        },
        {
            "floor (unpacked block)": floor,
            "wt_nccl unpacked": sync_with({"packed": False}),
        },
    ]
    times: dict[str, list[float]] = {}
    for block in blocks:
        for prepare in block.values():  # warm-up: first touches, allocator growth
            prepare(1)()
        for r in range(args.repeats):
            for name, prepare in block.items():
                run = prepare(r % 2)
                t0 = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - t0)

    # Correctness: what the engine serves now equals a sync of the same target.
    last = (args.repeats - 1) % 2
    prompt = "w1 w2 w3 w4"
    after_reload = _greedy(llm, prompt)
    sync_with({})(1 - last)()
    sync_with({})(last)()
    after_sync = _greedy(llm, prompt)
    if after_sync != after_reload:
        print("MISMATCH: tokens after wt_nccl differ from tokens after vLLM's reload")
        return 1

    rows = []
    print(f"\n{'method':<34} {'median s':>9} {'GB/s':>7} {'x floor':>8}")
    for name, ts in times.items():
        floor_name = "floor (unpacked block)" if "unpacked" in name else next(iter(times))
        base = statistics.median(times[floor_name])
        med = statistics.median(ts)
        rows.append({"method": name, "median_s": med, "times_s": ts, "ratio_to_floor": med / base})
        print(f"{name:<34} {med:9.3f} {nbytes / 1e9 / med:7.2f} {med / base:8.2f}")
    result = {"bytes": nbytes, "layers": args.layers, "repeats": args.repeats, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwritten: {args.out}")
    connected["engine"].shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
