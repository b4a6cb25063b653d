"""Syncs into an in-process vLLM `LLM` through `LocalVLLMWeightSyncClient`.

After every sync the engine must produce exactly (tokens and logprobs) what a
fresh engine loaded from the target checkpoint produces; after every failed
sync exactly what it produced before.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tests.sources import DisagreeingSource
from tests.vllm.conftest import (
    LONG_PROMPTS,
    MAX_TOKENS,
    PROMPTS,
    AlteredSource,
    References,
    ServedEngines,
    generate,
    hf_model,
    sampling_params,
)
from weight_transfer import ModuleSource, WeightSyncRPCError
from weight_transfer.runtime.control import SEAL_FIELD
from weight_transfer.vllm.metrics import engine_metrics

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKENDS = ["nccl", "ipc", "example_file"]


@pytest.mark.parametrize("backend", [*BACKENDS, "sharded_rdt"])
def test_three_rounds_match_fresh_engines(
    served: ServedEngines, references: References, backend: str
) -> None:
    engine = served(backend)
    assert generate(engine.llm) == references.outputs(engine.seed)
    before = engine_metrics(engine.llm)
    for round_, seed in enumerate((2, 3, 2 if engine.seed != 2 else 1), start=1):
        version = f"{backend}-round-{round_}"
        engine.sync(seed, version=version)
        assert generate(engine.llm) == references.outputs(seed), f"round {round_} (seed {seed})"
        assert engine.llm.get_weight_version() == version
    # the engine's round metrics, read from the LLM, counted the three rounds
    label = type(engine.worker_engine.backend).__name__
    committed = engine_metrics(engine.llm)[label]["rounds"]["committed"]
    assert committed - (before[label]["rounds"]["committed"] if label in before else 0) == 3
    # vLLM's own outputs name the version that made their tokens: the trainer's label
    (out,) = engine.llm.generate(PROMPTS[:1], sampling_params(), use_tqdm=False)
    assert [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions] == [
        (version, 0, MAX_TOKENS)
    ]


MID_LENGTH, MID_BOUNDARY = 24, 9  # output tokens of the stepped request; the round after


def test_a_round_mid_generation_switches_tokens_and_version_at_one_token(
    served: ServedEngines, references: References
) -> None:
    """A round under `pause="keep"` after `MID_BOUNDARY` tokens of a greedy generation
    (the engine stepped by hand, so the round lands at a known token): the output's
    spans name the old version up to the boundary and the new one after it; the
    tokens before it are the old weights' greedy continuation, those after it a
    fresh engine's continuation on the new weights."""
    from vllm import SamplingParams

    engine = served("nccl")
    old, new = engine.seed, 3 if engine.seed == 2 else 2
    engine.sync(old, version="mid-old")
    params = SamplingParams(temperature=0.0, max_tokens=MID_LENGTH, ignore_eos=True)
    core = engine.llm.llm_engine
    core.add_request("mid-round", PROMPTS[1], params)

    def step_until(done: Any) -> Any:
        for _ in range(4 * MID_LENGTH):
            outputs = core.step()
            if outputs and done(outputs[-1]):
                return outputs[-1]
        raise AssertionError(f"no output satisfied {done} in {4 * MID_LENGTH} steps")

    try:
        before = step_until(lambda out: len(out.outputs[0].token_ids) >= MID_BOUNDARY)
        boundary = len(before.outputs[0].token_ids)
        assert boundary == MID_BOUNDARY, "a step made more than one token"
        engine.sync(new, version="mid-new")  # pauses with the request kept, resumes it
        done = step_until(lambda out: out.finished)
    finally:
        core.abort_request(["mid-round"])  # a no-op once it finished
    tokens, prompt = list(done.outputs[0].token_ids), list(done.prompt_token_ids)
    assert [(s.version, s.start, s.end) for s in done.outputs[0].weight_versions] == [
        ("mid-old", 0, boundary),
        ("mid-new", boundary, MID_LENGTH),
    ]

    def greedy(seed: int, prompt_ids: list[int], count: int) -> list[int]:
        references.outputs(seed)  # starts the seed's fresh engine
        params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
        (out,) = references.engines[seed].generate(
            {"prompt_token_ids": prompt_ids}, params, use_tqdm=False
        )
        return list(out.outputs[0].token_ids)

    assert tokens[:boundary] == greedy(old, prompt, boundary)
    rest = prompt + tokens[:boundary], MID_LENGTH - boundary
    assert tokens[boundary:] == greedy(new, *rest)
    assert tokens[boundary:] != greedy(old, *rest), "the two weights agree: the test shows nothing"


def _bad_sources(seed: int) -> dict[str, tuple[Any, str]]:
    """Sources that agree with their own metadata but not with the model, and the
    name each error must mention."""
    model = hf_model(seed)
    params = dict(model.named_parameters())
    down = "model.layers.1.mlp.down_proj.weight"
    qkv = "model.layers.1.self_attn.k_proj.weight"
    return {
        "wrong-shape": (AlteredSource(model, {down: (down, torch.zeros(7, 128))}), down),
        "wrong-shape-attn": (AlteredSource(model, {qkv: (qkv, torch.zeros(64, 7))}), qkv),
        "unknown-name": (
            AlteredSource(
                model, {down: ("model.layers.1.mlp.bogus_proj.weight", params[down].detach())}
            ),
            "bogus_proj",
        ),
    }


def test_sync_invalidates_the_prefix_cache(served: ServedEngines, references: References) -> None:
    """A prompt cached before a sync must be recomputed with the new weights."""
    engine = served("nccl")
    first, second = (2, 3) if engine.seed != 2 else (3, 2)
    for seed in (first, second):
        references.outputs(seed)  # starts the reference engine
    engine.sync(first)
    assert generate(engine.llm, LONG_PROMPTS) == generate(references.engines[first], LONG_PROMPTS)
    engine.sync(second)  # the long prompt's KV blocks are cached with the old weights
    assert generate(engine.llm, LONG_PROMPTS) == generate(references.engines[second], LONG_PROMPTS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["wrong-shape", "wrong-shape-attn", "unknown-name"])
def test_failed_sync_keeps_previous_weights(
    served: ServedEngines, references: References, backend: str, case: str
) -> None:
    engine = served(backend)
    before = generate(engine.llm)
    assert before == references.outputs(engine.seed)
    target = 3 if engine.seed == 2 else 2
    source, mentioned = _bad_sources(target)[case]
    with pytest.raises(WeightSyncRPCError) as failure:
        engine.send(source)
    assert failure.value.method == "update_weights"
    assert mentioned in str(failure.value)
    assert generate(engine.llm) == before, "a failed sync changed what the engine serves"
    engine.sync(target, version=f"after-{case}")
    assert generate(engine.llm) == references.outputs(target)
    assert engine.llm.get_weight_version() == f"after-{case}"


@pytest.mark.parametrize("backend", ["nccl", "ipc", "sharded_rdt"])
def test_trainer_side_failure_keeps_previous_weights(
    served: ServedEngines, references: References, backend: str
) -> None:
    """The trainer's source breaks mid-round: workers roll back, the trainer sees its error."""
    engine = served(backend)
    before = generate(engine.llm)
    target = 3 if engine.seed == 2 else 2
    tensors = {n: p.detach() for n, p in hf_model(target).named_parameters()}
    at = len(tensors) - 3  # after both decoder layers went out
    with pytest.raises(ValueError, match="disagrees with metadata"):
        engine.send(DisagreeingSource(tensors, "reshape", at))
    assert generate(engine.llm) == before
    engine.sync(target)
    assert generate(engine.llm) == references.outputs(target)


def test_failed_finish_keeps_previous_weights(
    served: ServedEngines, references: References
) -> None:
    """`finish_weight_update` failing inside the engine rolls the whole round back.

    Layer 1's v_proj is withheld, so its fused qkv layer is only processed at
    finish, after every other layer already took the new weights; that
    processing is made to fail.
    """
    engine = served("example_file")
    before = generate(engine.llm)
    worker = engine.llm.llm_engine.model_executor.driver_worker.worker
    target = 3 if engine.seed == 2 else 2
    qkv = worker.get_model().model.layers[1].self_attn.qkv_proj
    method = qkv.quant_method

    def fail(layer: Any) -> None:
        raise RuntimeError("processing qkv_proj failed (injected)")

    worker.start_weight_update()
    loader = worker.weight_transfer_engine.loader
    pairs = [
        (n, p.detach().clone())
        for n, p in hf_model(target).named_parameters()
        if n != "model.layers.1.self_attn.v_proj.weight"
    ]
    loader.load(pairs)
    worker.update_weights(engine.trainer.client.control.sign({SEAL_FIELD: True}))  # as its trainer
    method.process_weights_after_loading = fail
    try:
        with pytest.raises(RuntimeError, match="injected"):
            worker.finish_weight_update()
    finally:
        del method.process_weights_after_loading
    worker.finish_weight_update()  # what a caller retries; the round is already closed
    assert not worker._weight_update_active
    assert generate(engine.llm) == before
    engine.sync(target)
    assert generate(engine.llm) == references.outputs(target)


def test_loader_snapshot_is_small_on_cpu(served: ServedEngines, references: References) -> None:
    """On CPU the undo copy holds the materialized tensors only (no packed Linear weights)."""
    engine = served("example_file")
    from weight_transfer.vllm.loader import VLLMLoader

    loader = engine.worker_engine.new_loader()
    assert isinstance(loader, VLLMLoader)
    loader.begin()
    assert loader.snapshot is None  # nothing happens to the model before the first update
    loader.prepare()
    try:
        assert loader.snapshot is not None
        total = sum(p.numel() * p.element_size() for p in hf_model(1).parameters())
        assert 0 < loader.snapshot.nbytes < total
    finally:
        loader.abort()
    assert generate(engine.llm) == references.outputs(engine.seed)


def test_module_source_matches_checkpoint(tiny_dirs: Any) -> None:
    """The trainer-side model of a seed is the checkpoint of that seed."""
    import os

    from safetensors.torch import load_file

    saved = load_file(os.path.join(tiny_dirs[2], "model.safetensors"))
    for name, tensor in ModuleSource(hf_model(2)):
        assert torch.equal(saved[name], tensor), name


def test_without_an_undo_copy_a_failed_round_keeps_generation_paused_until_one_lands(
    served: ServedEngines, references: References, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`WT_VLLM_SNAPSHOT=none`: no undo copy, so a round that fails after loading
    leaves layers of the new weights; the engine says so, generation stays paused
    (nobody is served that model), and the next complete round serves again."""
    from weight_transfer.runtime.control import Refusal, refused
    from weight_transfer.vllm.loader import SNAPSHOT_ENV

    engine = served("nccl")
    core = engine.llm.llm_engine.engine_core.engine_core  # the in-process engine core
    monkeypatch.setenv(SNAPSHOT_ENV, "none")
    target = 3 if engine.seed == 2 else 2
    source, _ = _bad_sources(target)["wrong-shape"]
    try:
        with pytest.raises(WeightSyncRPCError) as failure:
            engine.send(source)
        assert refused(failure.value, Refusal.MODEL_INCOMPLETE), failure.value
        assert "down_proj" in str(failure.value)
        assert core.is_scheduler_paused(), "an incomplete model was resumed"
        engine.sync(target)
        assert not core.is_scheduler_paused()
        assert generate(engine.llm) == references.outputs(target)
    finally:
        engine.client.resume_generation()  # whatever failed, the shared engine serves


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_complete_sync_logs_no_load_warning_and_a_partial_one_still_does(
    served: ServedEngines, references: References
) -> None:
    """The reload's "Failed to load weights" stays meaningful: not on every correct
    sync (rotary caches hold derived buffers only), but for a layer left out."""
    from weight_transfer.vllm.loader import RELOAD_LOGGER

    engine = served("nccl")
    records = _Records()
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.addHandler(records)
    try:
        engine.sync(3)
        assert generate(engine.llm) == references.outputs(3)
        assert not [m for m in records.messages if "Failed to load weights" in m]

        model = hf_model(2)
        left_out = "model.layers.1.mlp.down_proj.weight"
        engine.send(_Without(model, left_out))
        warned = [m for m in records.messages if "Failed to load weights" in m]
        assert warned and all("RotaryEmbedding" not in m for m in warned), warned
    finally:
        reload_logger.removeHandler(records)
        engine.sync(2)


class _Without(AlteredSource):
    """A model's parameters without one of them (metadata and iteration agree)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        super().__init__(module, {})
        self.name = name

    def _pairs(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in super()._pairs() if n != self.name]


def test_a_round_that_reaches_no_update_never_makes_the_model_unservable(
    served: ServedEngines, references: References
) -> None:
    """Generation that runs between a start and its finish (nothing paused it)
    serves the previous weights when no update has arrived yet."""
    engine = served("nccl")
    llm = engine.llm
    llm.start_weight_update()
    try:
        assert generate(llm) == references.outputs(engine.seed)
        with pytest.raises(Exception, match="before the trainer sealed the round"):
            llm.finish_weight_update()  # a finish from anyone but the trainer: the round stays
        assert generate(llm) == references.outputs(engine.seed)
    finally:
        engine.trainer.client.abort_round("the test ends the round it left open")
    assert generate(llm) == references.outputs(engine.seed)
    engine.sync(3 if engine.seed != 3 else 2)
    assert generate(llm) == references.outputs(engine.seed)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="vLLM's CPU build quantizes nothing online: FP8 needs its CUDA kernels, and its "
    "int8 method quantizes fused-MoE experts only, for which it has no CPU kernel",
)
@pytest.mark.parametrize("quantization", ["fp8_per_tensor", "fp8_per_block"])
def test_a_bf16_sync_into_an_engine_quantizing_online_equals_a_fresh_quantized_engine(
    tiny_dirs: Any, quantization: str, tmp_path: Any
) -> None:
    """A BF16 trainer sends the checkpoint's weights; the engine's layerwise reload
    quantizes them. After each round every parameter (FP8 weights and their scales)
    equals a fresh quantized engine's of the target, and so do the tokens; a refused
    round changes nothing. The sync's time is printed beside vLLM's own reload."""
    import time

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from tests.sources import DictSource
    from tests.vllm.conftest import INITIAL_SEED, KEEP_ALIVE, LLM_KWARGS, connect, engine_state
    from weight_transfer import LocalVLLMWeightSyncClient

    kwargs = {**LLM_KWARGS, "dtype": "bfloat16", "quantization": quantization}
    llm = LLM(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend="wt_nccl"),
        **kwargs,
    )
    KEEP_ALIVE.append(llm)
    fresh: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}
    for seed in (2, 3):
        reference = LLM(model=tiny_dirs[seed], **kwargs)
        KEEP_ALIVE.append(reference)
        fresh[seed] = (generate(reference), engine_state(reference))
    assert any(t.dtype == torch.float8_e4m3fn for t in fresh[2][1].values()), quantization

    def weights(seed: int) -> dict[str, torch.Tensor]:  # what a BF16 trainer holds
        return {n: p.detach().to(torch.bfloat16) for n, p in hf_model(seed).named_parameters()}

    source = DictSource(weights(2))
    trainer = connect("nccl", LocalVLLMWeightSyncClient(llm), source, str(tmp_path))
    seconds: dict[str, list[float]] = {"wt": [], "reload": []}
    try:
        for seed in (2, 3, 2):
            source.tensors = weights(seed)
            t0 = time.perf_counter()
            trainer.send_weights()
            seconds["wt"].append(time.perf_counter() - t0)
            tokens, state = fresh[seed]
            got = engine_state(llm)
            assert [n for n in state if not torch.equal(got[n], state[n])] == [], seed
            assert generate(llm) == tokens, seed
        before = engine_state(llm)
        down = "model.layers.1.mlp.down_proj.weight"
        source.tensors = {**weights(3), down: torch.zeros(7, 128, dtype=torch.bfloat16)}
        with pytest.raises(Exception, match="down_proj"):
            trainer.send_weights()
        after = engine_state(llm)
        assert [n for n in before if not torch.equal(after[n], before[n])] == []
    finally:
        trainer.shutdown()
    for seed in (3, 2):
        t0 = time.perf_counter()
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": tiny_dirs[seed], "is_checkpoint_format": True}
        )
        seconds["reload"].append(time.perf_counter() - t0)
    assert generate(llm) == fresh[2][0]
    wt, reload = sorted(seconds["wt"]), sorted(seconds["reload"])
    print(f"{quantization}: wt sync {wt} s, vLLM's reload of the same engine {reload} s")
