"""LoRA adapters synced into live vLLM engines: an in-process `LLM` here and the
session's nccl HTTP server (the `LLM` in a Ray actor: `test_ray.py`).

Every synced adapter is compared, tokens and logprobs, with the same engine
running the same adapter loaded by vLLM from a PEFT checkpoint on disk. What
an adapter or an HTTP caller sends must never kill the engine or decide what a
synced name serves: malformed adapters, squatted names, aliases of removed
adapters, colliding ids.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections.abc import Iterator
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
    Adapter,
    HTTPVLLMWeightSyncClient,
    LocalVLLMWeightSyncClient,
    LoRASource,
    ParamMeta,
    WeightSource,
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
        # removing one leaves the other; a request on the removed one fails alone
        remove_adapter(trainer, "beta")
        assert llm.collective_rpc(_served_adapters) == [["alpha"]]
        with pytest.raises(ValueError, match="'beta', which this engine does not serve"):
            generate(llm, lora_request=lora_request("beta"))
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


def _crc_colliding_names() -> tuple[str, str]:
    """Two adapter names whose CRC-32 ids (`2**30 + crc32(name) % 2**30`) are equal."""
    seen: dict[int, str] = {}
    for i in itertools.count():
        name = f"lora-{i}"
        key = zlib.crc32(name.encode()) % (1 << 30)
        if key in seen:
            return seen[key], name
        seen[key] = name
    raise AssertionError("unreachable")


def test_two_adapter_names_never_share_an_id_in_one_engine(lora_llm: Any, tmp_path: Any) -> None:
    """Two names whose CRC-32 ids collide each serve their own adapter (vLLM caches
    adapters by id: under one id they served each other's weights)."""
    from weight_transfer.vllm.adapters import lora_request

    llm = lora_llm
    disk = Checkpoints(str(tmp_path))
    first, second = _crc_colliding_names()
    model = peft_model("one", "two", seed=6)
    source = LoRASource(model, "one", name=first)
    trainer = connect("nccl", LocalVLLMWeightSyncClient(llm), source, str(tmp_path))
    try:
        trainer.send_weights()
        source.select("two", name=second)
        trainer.send_weights()
        assert lora_request(first).lora_int_id != lora_request(second).lora_int_id
        one = generate(llm, lora_request=lora_request(first))
        two = generate(llm, lora_request=lora_request(second))
        assert one == generate(llm, lora_request=disk.disk_request(model, "one"))
        assert two == generate(llm, lora_request=disk.disk_request(model, "two"))
        assert one != two
        for name in (first, second):
            remove_adapter(trainer, name)
    finally:
        trainer.shutdown()


class CraftedAdapter(WeightSource):
    """An adapter round as any trainer could send it: any config, any tensors."""

    def __init__(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]):
        self.adapter = Adapter(name, config)
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


def _of_rank(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """`tensors` with every `lora_A` and `lora_B` replaced by random ones of `rank`."""
    generator = torch.Generator().manual_seed(rank)
    out = {}
    for name, t in tensors.items():
        shape = (rank, t.shape[1]) if ".lora_A." in name else (t.shape[0], rank)
        out[name] = torch.randn(shape, generator=generator) * 0.1
    return out


def test_malformed_adapters_are_refused_naming_the_module_and_the_server_serves_on(
    servers: Any, tmp_path: Any
) -> None:
    """On the session's nccl server, each adapter round below is refused before it
    commits, naming the module and the field; the adapter synced before keeps serving,
    the base model too, and the engine never dies: a config `r` of 8 with rank-32
    tensors (within `--max-lora-rank 16` by its config: it killed the engine at the
    first request), `r` of 8 with rank-16 tensors (it loaded with the wrong scaling),
    rank-0 tensors (it served the base model), a module's `lora_B` without its
    `lora_A` (that module was dropped) and the reverse, a name of the served base
    model (requests on it got the base model). The next good round lands."""
    from tests.vllm.servers import SERVED_NAME

    server = servers("nccl")[0]
    model = peft_model("shape", seed=3)
    good_source = LoRASource(model, "shape")
    good = dict(iter(good_source))
    config = good_source.adapter.config
    source = CraftedAdapter("lora-shape", config, good)
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    trainer = connect("nccl", client, source, str(tmp_path))
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    module = "'model.layers.0.self_attn.q_proj'"
    try:
        trainer.send_weights()
        before, base = server.generate("lora-shape"), server.generate()
        assert before != base
        cases = [
            ({**config, "r": 8}, _of_rank(good, 32), "lora_A of rank 32 .* rank 8"),
            ({**config, "r": 8}, good, "lora_A of rank 16 and lora_B of rank 16, but field "
             "'config.r' gives it rank 8"),
            (config, _of_rank(good, 0), "lora_A of rank 0 and lora_B of rank 0"),
            (config, {n: t for n, t in good.items() if n != f"{q_proj}.lora_A.weight"},
             f"module {module} has no lora_A"),
            (config, {n: t for n, t in good.items() if n != f"{q_proj}.lora_B.weight"},
             f"module {module} has no lora_B"),
        ]  # fmt: skip
        for case_config, tensors, why in cases:
            source.adapter, source.tensors = Adapter("lora-shape", case_config), tensors
            with pytest.raises(WeightSyncRPCError, match=why):
                trainer.send_weights()
            assert server.generate("lora-shape") == before, why
            assert server.generate() == base, why
        source.adapter, source.tensors = Adapter(SERVED_NAME, config), good
        with pytest.raises(ValueError, match=r"field 'name' .* served base model"):
            trainer.send_weights()
        assert server.generate(SERVED_NAME) == base
        train_step(model, "shape", 3)
        source.adapter, source.tensors = Adapter("lora-shape", config), dict(iter(good_source))
        trainer.send_weights()
        assert server.generate("lora-shape") not in (before, base)
        remove_adapter(trainer, "lora-shape")
    finally:
        trainer.shutdown()
        client.close()


def _models(server: Any) -> dict[str, str]:
    """The server's model names and the path each points at (`/v1/models`)."""
    response = server.http.get("/v1/models")
    response.raise_for_status()
    return {card["id"]: card["root"] for card in response.json()["data"]}


def _register(server: Any, name: str, path: str, *, inplace: bool = False) -> Any:
    body: dict[str, Any] = {"lora_name": name, "lora_path": path}
    if inplace:
        body["load_inplace"] = True
    return server.http.post("/v1/load_lora_adapter", json=body)


def test_no_http_caller_decides_what_a_synced_adapter_name_serves(
    servers: Any, tmp_path: Any
) -> None:
    """A caller registers the trainer's adapter name first, with its own adapter: the
    trainer's sync makes the name serve the trainer's adapter (and point at it);
    re-registered in place after the sync, the name still serves the trainer's
    adapter, and the next sync points it back. A caller's alias of the synced
    adapter serves it, and is unregistered with it; a removed adapter cannot be
    registered again. (Before, the caller's adapter served under the name.)"""
    server = servers("nccl")[0]
    disk = Checkpoints(str(tmp_path))
    ours, theirs = peft_model("mine", seed=4), peft_model("theirs", seed=5)
    theirs_dir, _, _ = disk.save(theirs, "theirs")

    def from_disk(model: Any, adapter: str) -> Any:
        directory, name, _ = disk.save(model, adapter)
        assert _register(server, name, directory).status_code == 200
        return server.generate(name)

    their_outputs, base = from_disk(theirs, "theirs"), server.generate()
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    source = LoRASource(ours, "mine", name="squatted")
    trainer = connect("nccl", client, source, str(tmp_path))
    try:
        assert _register(server, "squatted", theirs_dir).status_code == 200
        assert server.generate("squatted") == their_outputs
        trainer.send_weights()
        mine = from_disk(ours, "mine")
        assert server.generate("squatted") == mine != their_outputs
        assert _models(server)["squatted"] == "wt-adapter:squatted"

        assert _register(server, "squatted", theirs_dir, inplace=True).status_code == 200
        assert server.generate("squatted") == mine
        train_step(ours, "mine", 1)
        trainer.send_weights()
        assert _models(server)["squatted"] == "wt-adapter:squatted"
        mine = from_disk(ours, "mine")
        assert server.generate("squatted") == mine

        assert _register(server, "an-alias", "wt-adapter:squatted").status_code == 200
        assert server.generate("an-alias") == mine
        remove_adapter(trainer, "squatted")
        assert {"squatted", "an-alias"}.isdisjoint(_models(server))
        again = _register(server, "an-alias", "wt-adapter:squatted")
        assert again.status_code >= 400 and "No adapter found for wt-adapter:squatted" in again.text
        assert server.generate() == base
    finally:
        trainer.shutdown()
        client.close()


class KeepsAliases:
    """An HTTP client whose removal unregisters the adapter's own name only, as when a
    caller registers an alias after the client listed the server's names."""

    def __init__(self, inner: HTTPVLLMWeightSyncClient) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def adapter_landed(self, adapter: Adapter) -> None:
        if adapter.remove:
            self.inner._unload_adapter(adapter.name)
        else:
            self.inner.adapter_landed(adapter)


def test_requests_on_an_alias_of_a_removed_adapter_fail_alone(servers: Any, tmp_path: Any) -> None:
    """An alias a caller registered for a synced adapter outlives the adapter's removal:
    a request on it queued behind a pause when the adapter goes, and one sent after,
    each fail alone (HTTP 500, vLLM's request-level error); the engine serves on. (Before,
    the first such request killed the engine core.)"""
    server = servers("nccl")[0]
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    source = LoRASource(peft_model("gone", seed=7), "gone", name="lora-gone")
    trainer = connect("nccl", KeepsAliases(http), source, str(tmp_path))
    body = {"model": "gone-alias", "prompt": "w1 w2", "max_tokens": 4, "temperature": 0.0}
    queued: list[Any] = []
    try:
        trainer.send_weights()
        base = server.generate()
        assert _register(server, "gone-alias", "wt-adapter:lora-gone").status_code == 200
        assert server.http.post("/v1/completions", json=body).status_code == 200
        http.pause_generation("keep")
        request = threading.Thread(
            target=lambda: queued.append(server.http.post("/v1/completions", json=body))
        )
        request.start()
        time.sleep(1.0)  # the request waits in the paused engine
        remove_adapter(trainer, "lora-gone")
        request.join(60)
        assert not request.is_alive()
        assert queued[0].status_code == 500, queued[0].text
        after = server.http.post("/v1/completions", json=body)
        assert after.status_code == 500, after.text
        assert server.generate() == base
        assert server.proc.poll() is None, "the server exited"
    finally:
        http.resume_generation()
        trainer.shutdown()
        http.close()
