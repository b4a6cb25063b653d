"""The live fused-MoE checks of `test_moe_vllm.py`, run in a process of their own.

vLLM's in-process engines share process-wide parallel groups, and a MoE model
needs an expert-parallel group that an engine of a dense model, started first
in the test process, never made. So `python -m tests.vllm.moe_checks ROOT OUT`
builds the tiny Qwen3-MoE checkpoints under ROOT, runs every check with real
in-process engines, and writes what it saw to OUT (JSON): per check, the
tensors that differ from a fresh engine of the target (bit-exact comparison),
whether the tokens and logprobs equal that engine's, and the errors raised.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from tests.vllm.conftest import engine_state as _state

SEEDS = (1, 2)
SYNCED = [("nccl", 64), ("nccl", 48)]  # 64: same shapes; 48: the kernel pads


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


class Engines:
    """Checkpoints, fresh engines and served engines, per experts intermediate size."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dirs: dict[tuple[int, int], str] = {}
        self.fresh: dict[tuple[int, int], tuple[Any, dict[str, torch.Tensor]]] = {}
        self.served: dict[tuple[str, int], Any] = {}
        self.keep: list[Any] = []  # a collected LLM tears down the process-wide groups

    def dir(self, inter: int, seed: int) -> str:
        from wt_tools.tiny_model import TinyMoESpec, build_tiny_moe

        key = (inter, seed)
        if key not in self.dirs:
            spec = TinyMoESpec(moe_intermediate_size=inter)
            path = os.path.join(self.root, f"moe{inter}-{seed}")
            self.dirs[key] = build_tiny_moe(path, seed=seed, spec=spec)
        return self.dirs[key]

    def llm(self, path: str, backend: str | None = None) -> Any:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from tests.vllm.conftest import LLM_KWARGS

        extra = {} if backend is None else {"weight_transfer_config": WeightTransferConfig(
            backend=f"wt_{backend}"
        )}  # fmt: skip
        llm = LLM(model=path, **LLM_KWARGS, **extra)
        self.keep.append(llm)
        return llm

    def reference(self, inter: int, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
        from tests.vllm.conftest import generate

        key = (inter, seed)
        if key not in self.fresh:
            llm = self.llm(self.dir(inter, seed))
            self.fresh[key] = (generate(llm), _state(llm))
        return self.fresh[key]

    def engine(self, backend: str, inter: int) -> Any:
        """An engine of `backend` serving seed 1."""
        if (backend, inter) not in self.served:
            self.served[(backend, inter)] = self.llm(self.dir(inter, 1), backend)
        return self.served[(backend, inter)]

    def compare(self, llm: Any, inter: int, seed: int) -> dict[str, Any]:
        """Which tensors differ from a fresh engine of (`inter`, `seed`), and its tokens."""
        from tests.vllm.conftest import generate

        tokens, state = self.reference(inter, seed)
        got = _state(llm)
        return {
            "differ": [n for n in state if not torch.equal(got[n], state[n])],
            "tokens_equal": generate(llm) == tokens,
        }


def _trainer(backend: str, llm: Any, tensors: dict[str, torch.Tensor], scratch: str) -> Any:
    from tests.sources import DictSource
    from tests.vllm.conftest import connect
    from weight_transfer import LocalVLLMWeightSyncClient

    return connect(backend, LocalVLLMWeightSyncClient(llm), DictSource(tensors), scratch)


def _error(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def check_syncs(e: Engines, scratch: str) -> dict[str, Any]:
    out = {}
    for backend, inter in SYNCED:
        llm = e.engine(backend, inter)
        steps = [{"what": "before any sync", **e.compare(llm, inter, 1)}]
        trainer = _trainer(backend, llm, _checkpoint(e.dir(inter, 1)), scratch)
        try:
            for seed, what in ((1, "the served weights again"), (2, "seed 2"), (1, "seed 1")):
                trainer.source.tensors = _checkpoint(e.dir(inter, seed))
                trainer.send_weights()
                steps.append({"what": what, **e.compare(llm, inter, seed)})
        finally:
            trainer.shutdown()
        out[f"{backend}-{inter}"] = steps
    return out


def check_partial(e: Engines, scratch: str) -> dict[str, Any]:
    llm = e.engine("nccl", 48)
    tensors = _checkpoint(e.dir(48, 2))
    partial = {n: t for n, t in tensors.items() if "layers.1.mlp.experts.3." not in n}
    trainer = _trainer("nccl", llm, partial, scratch)
    try:
        before = _state(llm)
        error = _error(trainer.send_weights)
        after = _state(llm)
        changed = [n for n in before if not torch.equal(after[n], before[n])]
        trainer.source.tensors = tensors
        trainer.send_weights()
        return {"error": error, "changed": changed, "then": e.compare(llm, 48, 2)}
    finally:
        trainer.shutdown()


def check_slices(e: Engines, scratch: str) -> dict[str, Any]:
    """wt_sharded_rdt: refused at init where the experts kernel prepacks (vLLM's CPU
    kernel); elsewhere synced (seed 2, then seed 1) and compared."""
    llm = e.engine("sharded_rdt", 48)
    trainer: Any = None

    def connect() -> None:
        nonlocal trainer
        trainer = _trainer("sharded_rdt", llm, _checkpoint(e.dir(48, 2)), scratch)

    error = _error(connect)
    if trainer is None:
        return {"error": error, "then": e.compare(llm, 48, 1)}
    steps = []
    try:
        for seed in (2, 1):
            trainer.source.tensors = _checkpoint(e.dir(48, seed))
            trainer.send_weights()
            steps.append({"what": f"seed {seed}", **e.compare(llm, 48, seed)})
    finally:
        trainer.shutdown()
    return {"error": None, "steps": steps}


def check_sparse(e: Engines, scratch: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    from weight_transfer import LocalVLLMWeightSyncClient, WeightTransferTrainerFactory
    from wt_kits.group.stateless import free_port
    from wt_sparse_nccl import SparseNCCLTrainerInitInfo, SparseWeightPatch

    llm = e.engine("sparse_nccl", 64)
    info = SparseNCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 2, rank=0, timeout_s=60.0, device="cpu"
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=LocalVLLMWeightSyncClient(llm))
    state, other = _checkpoint(e.dir(64, 1)), _checkpoint(e.dir(64, 2))
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    gen = torch.Generator().manual_seed(3)
    indices = torch.randperm(state[name].numel(), generator=gen)[: state[name].numel() // 10]
    try:
        same = SparseWeightPatch(name, indices, state[name].view(-1)[indices], state[name].shape)
        trainer.send_weights([same])
        unchanged = e.compare(llm, 64, 1)
        values = other[name].view(-1)[indices]
        trainer.send_weights([SparseWeightPatch(name, indices, values, other[name].shape)])
    finally:
        trainer.shutdown()
    state[name].view(-1)[indices] = values
    target = os.path.join(scratch, "patched")
    shutil.copytree(e.dir(64, 1), target)
    save_file(state, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    e.dirs[(0, 0)] = target  # the patched checkpoint's fresh engine, as (0, 0)
    return {"same_values": unchanged, "patched": e.compare(llm, 0, 0)}


CHECKS = {
    "syncs": check_syncs,
    "partial": check_partial,
    "slices": check_slices,
    "sparse": check_sparse,
}


def main(root: str, out: str) -> int:
    engines = Engines(root)
    results: dict[str, Any] = {}
    for name, check in CHECKS.items():
        scratch = os.path.join(root, f"scratch-{name}")
        os.makedirs(scratch, exist_ok=True)
        try:
            results[name] = check(engines, scratch)
        except Exception:
            results[name] = {"crashed": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
