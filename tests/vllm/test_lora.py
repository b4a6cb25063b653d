"""LoRA adapters synced into live vLLM engines: an in-process `LLM` here and the
session's nccl HTTP server (the `LLM` in a Ray actor: `test_ray.py`).

Every synced adapter is compared, tokens and logprobs, with the same engine
running the same adapter loaded by vLLM from a PEFT checkpoint on disk.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.vllm.conftest import (
    INITIAL_SEED,
    KEEP_ALIVE,
    LLM_KWARGS,
    TinyDirs,
    connect,
    generate,
    require_backend,
)
from tests.vllm.lora_parts import (
    ENGINE_LORA_KWARGS,
    RANK,
    Checkpoints,
    lora_bytes,
    peft_model,
    train_step,
)
from weight_transfer import (
    HTTPVLLMWeightSyncClient,
    LocalVLLMWeightSyncClient,
    LoRASource,
    WeightSyncRPCError,
    remove_adapter,
)
from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks

pytest.importorskip("vllm")
pytest.importorskip("peft")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def lora_llm(tiny_dirs: TinyDirs) -> Any:
    """An in-process `LLM` that takes LoRA adapters, on `wt_nccl`."""
    require_backend("nccl")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    llm = LLM(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend="wt_nccl"),
        **ENGINE_LORA_KWARGS,
        **LLM_KWARGS,
    )
    KEEP_ALIVE.append(llm)
    return llm


class BytesMoved:
    """What left the sender in each round (the `wt_chunk_moved` hook)."""

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}

    @hookimpl
    def wt_chunk_moved(self, sync_id: int, nbytes: int) -> None:
        self.rounds[sync_id] = self.rounds.get(sync_id, 0) + nbytes


def _base_weights(worker: Any) -> dict[str, torch.Tensor]:
    """In the worker: a copy of every base-model tensor (not the LoRA slots)."""
    model = worker.model_runner.get_model()
    return {
        n: t.detach().clone()
        for n, t in model.state_dict().items()
        if "lora_" not in n and "punica" not in n
    }


def _served_adapters(worker: Any) -> list[str]:
    from weight_transfer.vllm.adapters import store_for

    return sorted(store_for(worker.model_runner.get_model()).versions)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_adapters_are_added_updated_and_removed_by_name_in_a_running_llm(
    lora_llm: Any, tmp_path: Any
) -> None:
    from weight_transfer.vllm.adapters import lora_request

    llm = lora_llm
    disk = Checkpoints(str(tmp_path))
    base_outputs = generate(llm)
    [base_weights] = llm.collective_rpc(_base_weights)
    model = peft_model("alpha", "beta")
    source = LoRASource(model, "alpha")
    moved = BytesMoved()
    register_hooks(moved)
    trainer = connect("nccl", LocalVLLMWeightSyncClient(llm), source, str(tmp_path))
    try:
        # a new adapter: only its bytes travel
        trainer.send_weights()
        adapter_bytes = lora_bytes(model, "alpha")
        model_bytes = sum(p.numel() * p.element_size() for p in model.base_model.parameters())
        assert moved.rounds[1] == adapter_bytes == source.nbytes < model_bytes / 5
        first = generate(llm, lora_request=lora_request("alpha"))
        assert first == generate(llm, lora_request=disk.disk_request(model, "alpha"))
        assert first != base_outputs
        # an update of the same adapter
        train_step(model, "alpha", 1)
        trainer.send_weights()
        assert moved.rounds[2] == adapter_bytes
        second = generate(llm, lora_request=lora_request("alpha"))
        assert second == generate(llm, lora_request=disk.disk_request(model, "alpha"))
        assert second != first
        # a second adapter from the same trainer, beside the first
        source.select("beta")
        trainer.send_weights()
        beta = generate(llm, lora_request=lora_request("beta"))
        assert beta == generate(llm, lora_request=disk.disk_request(model, "beta"))
        assert beta not in (first, second)
        assert generate(llm, lora_request=lora_request("alpha")) == second
        assert llm.collective_rpc(_served_adapters) == [["alpha", "beta"]]
        # removing one leaves the other
        remove_adapter(trainer, "beta")
        assert llm.collective_rpc(_served_adapters) == [["alpha"]]
        assert generate(llm, lora_request=lora_request("alpha")) == second
        # the base model never moved
        assert generate(llm) == base_outputs
        [after] = llm.collective_rpc(_base_weights)
        assert _same_weights(after, base_weights)
    finally:
        plugin_manager().unregister(moved)
        trainer.shutdown()


class FailingLoRASource(LoRASource):
    """Raises after `fail_after` tensors of a round (a trainer that fails mid-adapter)."""

    fail_after: int | None = None

    def __iter__(self) -> Any:
        for i, pair in enumerate(super().__iter__()):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("the trainer failed mid-adapter")
            yield pair


def test_a_failed_adapter_round_keeps_the_old_adapter_and_the_next_round_works(
    lora_llm: Any, tmp_path: Any
) -> None:
    from weight_transfer.vllm.adapters import lora_request

    llm = lora_llm
    disk = Checkpoints(str(tmp_path))
    model = peft_model("gamma", seed=1)
    source = FailingLoRASource(model, "gamma")
    trainer = connect("nccl", LocalVLLMWeightSyncClient(llm), source, str(tmp_path))
    try:
        trainer.send_weights()
        before = generate(llm, lora_request=lora_request("gamma"))
        assert before == generate(llm, lora_request=disk.disk_request(model, "gamma"))
        base = generate(llm)

        # the trainer fails mid-adapter: some buckets were received, none applied
        train_step(model, "gamma", 1)
        source.fail_after = 20
        with pytest.raises(RuntimeError, match="mid-adapter"):
            trainer.send_weights()
        source.fail_after = None
        assert generate(llm, lora_request=lora_request("gamma")) == before

        # a malformed adapter: vLLM's check at commit names the module; nothing changes
        q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.gamma.weight"
        param = dict(model.named_parameters())[q_b]
        original = param.data
        param.data = original[:-8].clone()
        with pytest.raises(WeightSyncRPCError, match="q_proj"):
            trainer.send_weights()
        param.data = original
        assert generate(llm, lora_request=lora_request("gamma")) == before
        assert generate(llm) == base

        # the next round lands
        trainer.send_weights()
        after = generate(llm, lora_request=lora_request("gamma"))
        assert after == generate(llm, lora_request=disk.disk_request(model, "gamma"))
        assert after != before
    finally:
        trainer.shutdown()


def test_an_adapter_over_the_engine_max_rank_is_refused_naming_it(
    lora_llm: Any, tmp_path: Any
) -> None:
    from peft import LoraConfig, get_peft_model
    from wt_tools.tiny_model import tiny_llama

    wide = get_peft_model(
        tiny_llama(seed=INITIAL_SEED),
        LoraConfig(r=2 * RANK, target_modules=["q_proj"], init_lora_weights=False),
    )
    trainer = connect("nccl", LocalVLLMWeightSyncClient(lora_llm), LoRASource(wide), str(tmp_path))
    try:
        with pytest.raises(WeightSyncRPCError, match="rank 32 is greater than max_lora_rank 16"):
            trainer.send_weights()
    finally:
        trainer.shutdown()
    assert lora_llm.collective_rpc(_served_adapters)[0].count("default") == 0


def test_adapter_syncs_over_http_under_streamed_traffic(servers: Any, tmp_path: Any) -> None:
    """On the session's nccl server: the OpenAI `model` field names the synced
    adapter; streamed requests on it and on the base model during 10 syncs all
    complete; the base model's outputs never change; a removed name is refused."""
    from tests.vllm.servers import Traffic

    server = servers("nccl")[0]
    disk = Checkpoints(str(tmp_path))
    model = peft_model("delta", seed=2)
    source = LoRASource(model, "delta", name="lora-http")
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    base = server.generate()

    def disk_outputs() -> Any:
        directory, name, _ = disk.save(model, "delta")
        loaded = server.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": directory}
        )
        assert loaded.status_code == 200, loaded.text
        return server.generate(name)

    trainer = connect("nccl", client, source, str(tmp_path))
    try:
        trainer.send_weights()
        first = server.generate("lora-http")
        assert first == disk_outputs()
        with Traffic(server, model="lora-http") as on_adapter, Traffic(server) as on_base:
            for step in range(10):
                train_step(model, "delta", step)
                trainer.send_weights()
                time.sleep(0.2)
        assert on_adapter.failures == [] and on_base.failures == []
        assert on_adapter.done >= 5 and on_base.done >= 5
        last = server.generate("lora-http")
        assert last == disk_outputs()
        assert last != first
        assert server.generate() == base
        remove_adapter(trainer, "lora-http")
        refused = server.http.post(
            "/v1/completions", json={"model": "lora-http", "prompt": "w1", "max_tokens": 2}
        )
        assert refused.status_code == 404, refused.text
        assert server.generate() == base
    finally:
        trainer.shutdown()
        client.close()
