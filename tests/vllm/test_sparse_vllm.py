"""`sparse_nccl` into an in-process vLLM `LLM` (backend `wt_sparse_nccl`).

The test keeps the weights the engine should serve (the seed-1 checkpoint with
every applied patch) and, after each sync, writes them as a checkpoint and
compares the engine with a fresh `LLM` loaded from it: same greedy tokens, same
logprobs. After a failed round the engine must produce exactly what it produced
before, and the next round must again match a fresh engine (so the worker's
checkpoint mirror was rolled back too).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.vllm.conftest import (
    INITIAL_SEED,
    KEEP_ALIVE,
    LLM_KWARGS,
    Outputs,
    TinyDirs,
    generate,
)

pytest.importorskip("vllm")
pytest.importorskip("wt_sparse_nccl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_TOL = 1e-5
CHECKPOINT = "model.safetensors"

Q0, K0, DOWN0 = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
)
Q1, GATE1, NORM1 = (
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.post_attention_layernorm.weight",
)
EMBED, FINAL_NORM = "model.embed_tokens.weight", "model.norm.weight"


def assert_same_outputs(got: Outputs, want: Outputs, what: str) -> None:
    """Identical greedy tokens and top-logprob token ids; logprobs within `LOGPROB_TOL`."""
    assert len(got) == len(want), what
    for p, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(
        zip(got, want, strict=True)
    ):
        assert tokens == want_tokens, f"{what}: prompt {p} tokens"
        for pos, (row, want_row) in enumerate(zip(logprobs, want_logprobs, strict=True)):
            assert [t for t, _ in row] == [t for t, _ in want_row], f"{what}: {p}/{pos}"
            for (_, lp), (_, want_lp) in zip(row, want_row, strict=True):
                assert math.isclose(lp, want_lp, rel_tol=0.0, abs_tol=LOGPROB_TOL), (
                    f"{what}: prompt {p} position {pos}: {lp} != {want_lp}"
                )


def patch_of(
    state: dict[str, torch.Tensor],
    name: str,
    fraction: float,
    gen: torch.Generator,
    *,
    index_dtype: torch.dtype = torch.int64,
    scale: float = 0.5,
) -> Any:
    """A patch setting a random `fraction` of `state[name]`'s entries to random values."""
    from wt_sparse_nccl import SparseWeightPatch

    t = state[name]
    nnz = max(1, int(t.numel() * fraction))
    indices = torch.randperm(t.numel(), generator=gen)[:nnz].to(index_dtype)
    values = (torch.randn(nnz, generator=gen) * scale).to(t.dtype)
    return SparseWeightPatch(name, indices, values, tuple(t.shape))


def applied(state: dict[str, torch.Tensor], patches: Sequence[Any]) -> dict[str, torch.Tensor]:
    """`state` with `patches` applied in order (new tensors)."""
    out = {n: t.clone() for n, t in state.items()}
    for p in patches:
        out[p.name].view(-1)[p.indices.long()] = p.values
    return out


@dataclass
class SparseServed:
    """A `wt_sparse_nccl` engine, its trainer, and the weights it should serve."""

    llm: Any
    trainer: Any
    base_dir: str
    scratch: str
    state: dict[str, torch.Tensor]
    references: list[Any] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(7))

    @property
    def worker(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def fresh_outputs(self, state: dict[str, torch.Tensor]) -> Outputs:
        """What a fresh `LLM` loaded from `state` (as a checkpoint) generates."""
        from safetensors.torch import save_file
        from vllm import LLM

        path = os.path.join(self.scratch, f"target{len(self.references)}")
        os.makedirs(path)
        for entry in os.listdir(self.base_dir):
            if not entry.endswith(".safetensors"):
                shutil.copy(os.path.join(self.base_dir, entry), path)
        save_file(state, os.path.join(path, CHECKPOINT), metadata={"format": "pt"})
        llm = LLM(model=path, **LLM_KWARGS)
        KEEP_ALIVE.append(llm)
        self.references.append(llm)
        return generate(llm)

    def patches(self, spec: Sequence[tuple[str, float]], **kwargs: Any) -> list[Any]:
        return [patch_of(self.state, n, f, self.generator, **kwargs) for n, f in spec]

    def sync(self, chunks: Sequence[Sequence[Any]], version: str) -> None:
        """One round of `chunks` (several: `begin`, chunks, `end`); then `state` is the target."""
        if len(chunks) == 1:
            self.trainer.send_weights(chunks[0], weight_version=version)
        else:
            self.trainer.begin()
            for chunk in chunks:
                self.trainer.send_weight_chunk(chunk)
            self.trainer.end(version)
        for chunk in chunks:
            self.state = applied(self.state, chunk)

    def check_serves_state(self, what: str) -> Outputs:
        got = generate(self.llm)
        assert_same_outputs(got, self.fresh_outputs(self.state), what)
        return got


@pytest.fixture(scope="session")
def sparse_served(
    vllm_module: Any, tiny_dirs: TinyDirs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SparseServed]:
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer import LocalVLLMWeightSyncClient, WeightTransferTrainerFactory
    from wt_kits.group.stateless import free_port
    from wt_sparse_nccl import SparseNCCLTrainerInitInfo

    base = tiny_dirs[INITIAL_SEED]
    llm = LLM(
        model=base,
        weight_transfer_config=WeightTransferConfig(backend="wt_sparse_nccl"),
        **LLM_KWARGS,
    )
    KEEP_ALIVE.append(llm)
    info = SparseNCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 2, rank=0, timeout_s=60.0, device="cpu"
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=LocalVLLMWeightSyncClient(llm))
    served = SparseServed(
        llm,
        trainer,
        base,
        str(tmp_path_factory.mktemp("sparse-targets")),
        load_file(os.path.join(base, CHECKPOINT)),
    )
    yield served
    trainer.shutdown()


def test_provider_is_for_vllm_only(sparse_served: SparseServed) -> None:
    from wt_sparse_nccl import InPlacePatcher, patcher_for
    from wt_sparse_nccl.vllm_patcher import MirrorPatcher, vllm_patcher

    worker = sparse_served.worker
    model = worker.get_model()
    assert isinstance(patcher_for(model, worker.vllm_config), MirrorPatcher)
    assert vllm_patcher(model, None) is None
    assert isinstance(patcher_for(torch.nn.Linear(2, 2), None), InPlacePatcher)


def test_three_rounds_match_fresh_engines(sparse_served: SparseServed) -> None:
    from wt_sparse_nccl.vllm_patcher import mirror_of

    s = sparse_served
    before = generate(s.llm)
    assert_same_outputs(before, s.fresh_outputs(s.state), "initial")

    # Round 1: one decoder layer, into fused qkv and gate_up; int32 indices.
    s.sync([s.patches([(Q1, 0.05), (GATE1, 0.05)], index_dtype=torch.int32)], "sparse-1")
    after1 = s.check_serves_state("round 1")
    assert after1 != before
    assert s.llm.get_weight_version() == "sparse-1"
    mirror = mirror_of(s.worker.get_model(), s.worker.vllm_config)
    layer1 = [n for n in s.state if n.startswith("model.layers.1.")]
    assert sorted(mirror.tensors) == sorted(layer1), "only the touched layer is mirrored"
    for name in layer1:
        assert torch.equal(mirror.tensors[name], s.state[name]), name

    # Round 2: two chunks; the second rewrites some of the first's entries.
    first = s.patches([(EMBED, 0.02), (K0, 0.1), (FINAL_NORM, 0.5)])
    k0 = first[1]
    overlap = torch.cat([k0.indices[: k0.nnz // 2], torch.tensor([0, 1])]).unique()
    from wt_sparse_nccl import SparseWeightPatch

    rewrite = SparseWeightPatch(
        K0, overlap, torch.randn(overlap.numel(), generator=s.generator), k0.full_shape
    )
    s.sync([first, [rewrite, *s.patches([(DOWN0, 0.05)])]], "sparse-2")
    after2 = s.check_serves_state("round 2")
    assert after2 != after1
    assert s.llm.get_weight_version() == "sparse-2"

    # Round 3: a slice of every tensor.
    s.sync([s.patches([(n, 0.03) for n in s.state], scale=0.2)], "sparse-3")
    after3 = s.check_serves_state("round 3")
    assert after3 != after2
    assert s.llm.get_weight_version() == "sparse-3"
    assert mirror.nbytes == sum(t.numel() * t.element_size() for t in s.state.values())
    for name, tensor in s.state.items():
        assert torch.equal(mirror.tensors[name], tensor), name


def _bad_patch(s: SparseServed, case: str) -> tuple[Any, str]:
    """A patch the engine must refuse, and a piece of the error message."""
    from wt_sparse_nccl import SparseWeightPatch

    q = s.patches([(Q0, 0.01)])[0]
    if case == "unknown-name":
        return SparseWeightPatch(
            "model.layers.1.mlp.bogus.weight", q.indices, q.values, q.full_shape
        ), "bogus"
    if case == "vllm-only-name":
        fused = "model.layers.0.self_attn.qkv_proj.weight"
        return SparseWeightPatch(fused, q.indices, q.values, (256, 128)), "qkv_proj"
    if case == "wrong-shape":
        return SparseWeightPatch(Q0, q.indices, q.values, (256, 128)), "full shape"
    if case == "wrong-dtype":
        return SparseWeightPatch(Q0, q.indices, q.values.half(), q.full_shape), "float16"
    assert case == "index-out-of-range"
    indices = q.indices.clone()
    indices[-1] = q.numel
    return SparseWeightPatch(Q0, indices, q.values, q.full_shape), "outside"


@pytest.mark.parametrize(
    "case", ["unknown-name", "vllm-only-name", "wrong-shape", "wrong-dtype", "index-out-of-range"]
)
def test_failed_update_keeps_previous_weights(
    sparse_served: SparseServed, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused batch, after an earlier batch of the same round went through."""
    from weight_transfer import WeightSyncRPCError

    s = sparse_served
    before = generate(s.llm)
    version = s.llm.get_weight_version()
    bad, mentioned = _bad_patch(s, case)
    if case == "index-out-of-range":  # only the worker may catch it
        monkeypatch.setattr("wt_sparse_nccl.trainer.check_patches", lambda patches: None)
    s.trainer.begin()
    s.trainer.send_weight_chunk(s.patches([(Q1, 0.2), (EMBED, 0.1)]))
    with pytest.raises(WeightSyncRPCError) as failure:
        s.trainer.send_weight_chunk([*s.patches([(GATE1, 0.1)]), bad])
    assert failure.value.method == "update_weights"
    assert mentioned in str(failure.value)
    monkeypatch.undo()
    assert generate(s.llm) == before, "a failed round changed what the engine serves"
    assert s.llm.get_weight_version() == version

    s.sync([s.patches([(Q0, 0.05), (NORM1, 0.5)])], f"after-{case}")
    s.check_serves_state(f"after {case}")
    assert s.llm.get_weight_version() == f"after-{case}"


@pytest.mark.parametrize("where", ["load", "finalize"])
def test_failed_finish_keeps_previous_weights(sparse_served: SparseServed, where: str) -> None:
    """The reload at `finish_weight_update` fails: model and mirror roll back.

    "load": layer 1's qkv layer fails while its group loads (layer 0 already
    took the new weights). "finalize": the embedding, which vLLM processes
    only when the reload is finalized (its rows are padded), fails there.
    """
    from weight_transfer import WeightSyncRPCError

    s = sparse_served
    before = generate(s.llm)
    version = s.llm.get_weight_version()
    model = s.worker.get_model()
    if where == "load":
        module = model.model.layers[1].self_attn.qkv_proj
        patches = s.patches([(K0, 0.1), (Q1, 0.1)])
    else:
        module = model.model.embed_tokens
        patches = s.patches([(K0, 0.1), (EMBED, 0.1)])
    method = module.quant_method

    def fail(layer: Any) -> None:
        raise RuntimeError(f"processing failed at {where} (injected)")

    method.process_weights_after_loading = fail
    try:
        with pytest.raises(WeightSyncRPCError) as failure:
            s.trainer.send_weights(patches, weight_version="never")
    finally:
        del method.process_weights_after_loading
    assert failure.value.method == "finish_weight_update"
    assert "injected" in str(failure.value)
    s.llm.finish_weight_update()  # what a caller retries; the round is already over
    assert not s.worker._weight_update_active
    assert generate(s.llm) == before
    assert s.llm.get_weight_version() == version

    s.sync([s.patches([(K0, 0.05), (EMBED, 0.05), (Q1, 0.05)])], f"after-{where}")
    s.check_serves_state(f"after failed {where}")


def test_a_held_round_reverts_inside_vllm(sparse_served: SparseServed) -> None:
    """A commit held for a fleet (`wt_hold`) is taken back by `wt_revert`: the engine
    serves exactly what it served before, and its checkpoint mirror went back too (the
    next round matches a fresh engine). `wt_release` keeps the weights."""
    from weight_transfer import LocalVLLMWeightSyncClient
    from weight_transfer.runtime.control import HOLD_FIELD, RELEASE_FIELD, REVERT_FIELD

    s = sparse_served
    control = LocalVLLMWeightSyncClient(s.llm)

    def held_round(patches: list[Any], version: str) -> None:
        s.trainer.begin()
        s.trainer.client.update_weights({HOLD_FIELD: True})
        s.trainer.send_weight_chunk(patches)
        s.trainer.end(version)

    before, previous = generate(s.llm), s.state
    patches = s.patches([(Q1, 0.05), (GATE1, 0.05), (EMBED, 0.02)])
    held_round(patches, "held")
    assert_same_outputs(generate(s.llm), s.fresh_outputs(applied(previous, patches)), "held")
    sign = s.trainer.client.control.sign  # the fleet signs its controls with the trainer's key
    control.control_round({REVERT_FIELD: "another replica failed (test)"}, sign=sign)
    assert generate(s.llm) == before, "the revert did not restore what the engine served"

    kept = s.patches([(K0, 0.05), (NORM1, 0.5)])
    held_round(kept, "kept")
    kept_outputs = generate(s.llm)
    control.control_round({RELEASE_FIELD: "every replica finished (test)"}, sign=sign)
    assert generate(s.llm) == kept_outputs
    s.state = applied(previous, kept)

    s.sync([s.patches([(Q1, 0.05), (DOWN0, 0.05)])], "after-revert")
    s.check_serves_state("after a revert and a release")
