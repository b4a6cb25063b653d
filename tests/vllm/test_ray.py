"""`RayVLLMWeightSyncClient` against a vLLM `LLM` living in a Ray actor.

The Ray cluster is the session's loopback cluster (`ray_cluster`, `tests/conftest.py`;
`wt_tools.local_ray`). The trainer (this process) reaches the actor's worker over the
backend's own loopback group.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    LLM_KWARGS,
    PROMPTS,
    AlteredSource,
    Outputs,
    References,
    SwitchSource,
    TinyDirs,
    connect,
    hf_model,
    outputs_of,
    require_backend,
    sampling_params,
)
from tests.vllm.lora_parts import ENGINE_LORA_KWARGS
from weight_transfer import LoRASource, ModuleSource, RayVLLMWeightSyncClient, WeightSyncRPCError

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]

BACKEND = "nccl"
ACTOR_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def generate(actor: Any) -> Outputs:
    refs = actor.generate.remote(PROMPTS, sampling_params(), use_tqdm=False)
    return outputs_of(ray.get(refs, timeout=120))


def test_ray_actor_sync_over_ipc(
    ray_cluster: Any, tiny_dirs: TinyDirs, references: References, tmp_path: Any
) -> None:
    """`wt_ipc` in an `LLM` Ray actor on this host: the actor maps this process's
    shared memory; JSON payloads through Ray, tokens equal to fresh engines'; then
    LoRA adapters into the same actor."""
    require_backend("ipc")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    actor_cls = ray_cluster.remote(num_cpus=1, runtime_env={"env_vars": ACTOR_ENV})(LLM)
    actor = actor_cls.remote(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend="wt_ipc"),
        **ENGINE_LORA_KWARGS,  # base outputs stay bit-identical to a LoRA-less engine's
        **LLM_KWARGS,
    )
    try:
        ray_cluster.get(actor.get_weight_version.remote(), timeout=180)
        client = RayVLLMWeightSyncClient(actor, timeout=120.0)
        source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
        trainer = connect("ipc", client, source, str(tmp_path))
        try:
            for round_, seed in enumerate((3, 2), start=1):
                source.inner = ModuleSource(hf_model(seed))
                trainer.send_weights(weight_version=f"ray-ipc-{round_}")
                assert generate(actor) == references.outputs(seed), f"round {round_}"
                assert ray.get(actor.get_weight_version.remote(), timeout=60) == f"ray-ipc-{round_}"
            down = "model.layers.1.mlp.down_proj.weight"
            source.inner = AlteredSource(
                hf_model(3), {down: (down, hf_model(3).lm_head.weight.detach())}
            )
            with pytest.raises(WeightSyncRPCError, match="down_proj"):
                trainer.send_weights()
            assert generate(actor) == references.outputs(2)
            # vLLM's release of the trainer connection: inference goes on, and the
            # trainer's next round re-admits the worker
            client.shutdown_weight_transfer_engine()
            assert generate(actor) == references.outputs(2)
            source.inner = ModuleSource(hf_model(3))
            trainer.send_weights()
            assert generate(actor) == references.outputs(3)
        finally:
            trainer.shutdown()
        # vLLM's examples/rl/rlhf_ipc.py as its users port it: a trainer in a Ray actor
        # building its engine with the factory, `IPCTrainerInitInfo(rank=0, packed=False)`
        # (no worker count), the engine's own sleep / wake_up around the sync
        example = ray_cluster.remote(num_cpus=0)(_example_trainer_class()).remote(actor, 2)
        ray.get(actor.sleep.remote(level=0), timeout=60)
        ray.get(example.init_weight_transfer.remote(), timeout=120)
        ray.get(example.broadcast_weights.remote(), timeout=120)
        ray.get(actor.wake_up.remote(tags=["scheduling"]), timeout=60)
        assert generate(actor) == references.outputs(2)
        _sync_adapters_into_the_actor(actor, str(tmp_path))
        assert generate(actor) == references.outputs(2)
    finally:
        ray_cluster.kill(actor)


def _sync_adapters_into_the_actor(actor: Any, scratch: str) -> None:
    """A LoRA adapter over ipc into the actor's `LLM` through Ray: equal to the actor
    loading the same adapter from disk, round after round."""
    from tests.vllm.lora_parts import Checkpoints, peft_model, train_step
    from weight_transfer.vllm.adapters import lora_request

    def on(request: Any) -> Outputs:
        refs = actor.generate.remote(
            PROMPTS, sampling_params(), lora_request=request, use_tqdm=False
        )
        return outputs_of(ray.get(refs, timeout=120))

    disk = Checkpoints(scratch)
    model = peft_model("ray-lora", seed=3)
    client = RayVLLMWeightSyncClient(actor, timeout=120.0)
    client.shutdown_weight_transfer_engine()  # the example's trainer lets the engine go
    trainer = connect("ipc", client, LoRASource(model, "ray-lora"), scratch)
    try:
        seen = []
        for step in range(2):
            train_step(model, "ray-lora", step)
            trainer.send_weights()
            seen.append(on(lora_request("ray-lora")))
            assert seen[-1] == on(disk.disk_request(model, "ray-lora")), f"round {step + 1}"
        assert seen[0] != seen[1]
    finally:
        trainer.shutdown()


def _example_trainer_class() -> type:
    """The trainer actor of vLLM's `rlhf_ipc.py` example, with wt's two imports (and a
    CPU model); defined in a function so Ray ships the class by value to the actor."""

    class TrainModel:
        def __init__(self, llm_handle: Any, seed: int) -> None:
            from wt_tools.tiny_model import tiny_llama

            self.train_model = tiny_llama(seed=seed)
            self.llm_handle = llm_handle

        def init_weight_transfer(self) -> None:
            from weight_transfer import (
                ModuleSource,
                RayVLLMWeightSyncClient,
                WeightTransferTrainerFactory,
            )
            from wt_ipc import IPCTrainerInitInfo

            self.engine = WeightTransferTrainerFactory.trainer_init(
                init_info=IPCTrainerInitInfo(rank=0, packed=False),
                client=RayVLLMWeightSyncClient(self.llm_handle),
                source=ModuleSource(self.train_model),
            )

        def broadcast_weights(self) -> None:
            self.engine.send_weights()

    return TrainModel


def _async_llm_actor_class() -> type:
    """vLLM's `AsyncLLM` as a Ray actor: its own methods, plus `complete` for the test.

    Defined in a function so Ray ships the class by value to the actor.
    """
    import time

    from vllm.v1.engine.async_llm import AsyncLLM

    class AsyncLLMActor(AsyncLLM):  # type: ignore[misc]
        def __init__(self, **engine_kwargs: Any) -> None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.executor.abstract import Executor

            config = AsyncEngineArgs(**engine_kwargs).create_engine_config()
            super().__init__(
                vllm_config=config, executor_class=Executor.get_class(config), log_stats=False
            )

        async def complete(self, prompts: list[str], params: Any) -> list[Any]:
            outputs = []
            for i, prompt in enumerate(prompts):
                final = None
                async for out in self.generate(prompt, params, request_id=f"{time.time_ns()}-{i}"):
                    final = out
                outputs.append(final)
            return outputs

    return AsyncLLMActor


def test_ray_async_llm_actor_sync(
    ray_cluster: Any, tiny_dirs: TinyDirs, references: References, tmp_path: Any
) -> None:
    """A real `AsyncLLM` reads `request.init_info` / `request.update_info`: the
    client must send request objects, and it pauses through `pause_generation`."""
    require_backend(BACKEND)
    # `AsyncLLM` starts its engine core process whatever the setting; the setting's "0"
    # keeps the worker inside it (vLLM's `uni` executor), as in a one-GPU engine
    actor_cls = ray_cluster.remote(num_cpus=1, runtime_env={"env_vars": ACTOR_ENV})(
        _async_llm_actor_class()
    )
    actor = actor_cls.remote(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config={"backend": f"wt_{BACKEND}"},
        **LLM_KWARGS,
    )
    try:
        ray.get(actor.get_weight_version.remote(), timeout=240)

        def complete() -> Outputs:
            return outputs_of(
                ray.get(actor.complete.remote(PROMPTS, sampling_params()), timeout=120)
            )

        assert complete() == references.outputs(INITIAL_SEED)
        client = RayVLLMWeightSyncClient(actor, timeout=120.0)
        source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
        trainer = connect(BACKEND, client, source, str(tmp_path))
        try:
            for round_, seed in enumerate((3, 2), start=1):
                source.inner = ModuleSource(hf_model(seed))
                trainer.send_weights(weight_version=f"async-{round_}")
                assert complete() == references.outputs(seed), f"round {round_}"
                assert ray.get(actor.get_weight_version.remote(), timeout=60) == f"async-{round_}"
                assert ray.get(actor.is_paused.remote(), timeout=60) is False
        finally:
            trainer.shutdown()
    finally:
        ray_cluster.kill(actor)
