"""`wt_sharded_rdt` in live vLLM engines over NIXL, on a local Ray cluster (127.0.0.1).

- Two replicas, each an `LLM` in a Ray actor. The trainer (this process)
  hosts its producer as a Ray actor; each replica's worker records its
  model's slices once (a dry run of vLLM's own loaders) and then pulls them
  every sync. Greedy tokens and logprobs must equal a fresh engine loaded
  from the target weights, on both replicas; a sync that fails mid-way
  leaves both serving the previous weights, and the next works.
- With verified bytes, a byte flipped in a replica's receive slot fails the
  sync naming the parameter; both replicas keep serving the previous weights.
- A replica killed and started again as a new actor is re-admitted by the
  next sync (`reconnect`: every replica gets its handshake again) and then
  serves exactly what a fresh engine loaded from the target weights does.
- Two FSDP2 trainer ranks (gloo, a Ray actor each) sync both replicas from
  their local shards (`local_shards`): no rank runs an all-gather, and each
  serves about its share of the bytes the replicas pull.
- One engine with tensor parallelism 2 (vLLM's multiprocess executor; its
  worker processes join the Ray cluster as drivers from the handshake's
  address): each worker pulls about half of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.ray_parts import ACTOR_ENV, LOOPBACK_ENV
from tests.vllm.conftest import (
    INITIAL_SEED,
    LLM_KWARGS,
    PROMPTS,
    Outputs,
    References,
    SwitchSource,
    TinyDirs,
    hf_model,
    outputs_of,
    require_backend,
    sampling_params,
)
from weight_transfer import (
    FanOutClient,
    ModuleSource,
    ParamMeta,
    RayVLLMWeightSyncClient,
    WeightSource,
)

pytest.importorskip("vllm")
pytest.importorskip("nixl")
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

REPLICAS = 2
VLLM_ENV = {
    **ACTOR_ENV,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Any:
    """The session's loopback cluster (`tests/conftest.py`), where wt has sharded_rdt."""
    require_backend("sharded_rdt")
    return ray_cluster


def start_replicas(cluster: Any, tiny_dirs: TinyDirs, count: int) -> list[Any]:
    """`count` engines (an `LLM` each, in a Ray actor) serving the initial checkpoint, ready."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    actor_cls = cluster.remote(num_cpus=1, runtime_env={"env_vars": VLLM_ENV})(LLM)
    actors = [
        actor_cls.remote(
            model=tiny_dirs[INITIAL_SEED],
            weight_transfer_config=WeightTransferConfig(backend="wt_sharded_rdt"),
            **LLM_KWARGS,
        )
        for _ in range(count)
    ]
    cluster.get([a.get_weight_version.remote() for a in actors], timeout=240)
    return actors


@pytest.fixture(scope="module")
def replicas(cluster: Any, tiny_dirs: TinyDirs) -> Iterator[list[Any]]:
    actors = start_replicas(cluster, tiny_dirs, REPLICAS)
    yield actors  # a test that restarts one puts the new actor in its place
    for actor in actors:
        cluster.kill(actor)


def generate(actor: Any) -> Outputs:
    return outputs_of(
        ray.get(actor.generate.remote(PROMPTS, sampling_params(), use_tqdm=False), timeout=120)
    )


class FailingSource(ModuleSource):
    """A model whose iteration raises at `name` (a trainer rank that fails mid-sync)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        super().__init__(module)
        self.name = name

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().__iter__():
            if name == self.name:
                raise RuntimeError(f"lost the shard holding {name}")
            yield name, tensor


def clients_of(replicas: list[Any]) -> list[RayVLLMWeightSyncClient]:
    return [RayVLLMWeightSyncClient(a, timeout=120.0) for a in replicas]


def nixl_trainer(
    clients: list[RayVLLMWeightSyncClient], source: WeightSource, prefix: str, **kw: Any
) -> Any:
    """A sharded_rdt trainer over NIXL feeding every replica's client (fanned out)."""
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo

    info = ShardedRDTTrainerInitInfo(
        rank=0,
        num_consumers=REPLICAS,
        num_replicas=REPLICAS,
        transport="nixl",
        producer_prefix=prefix,
        timeout_s=120.0,
        stall_timeout_s=30.0,
        actor_env=LOOPBACK_ENV,
        **kw,
    )
    return ShardedRDTTrainerEngine.trainer_init(info, client=FanOutClient(clients), source=source)


def test_two_replicas_pull_over_nixl(replicas: list[Any], references: References) -> None:
    for actor in replicas:
        assert generate(actor) == references.outputs(INITIAL_SEED)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    clients = clients_of(replicas)
    trainer = nixl_trainer(clients, source, "wt-vllm-rdt")
    try:
        metas: list[ParamMeta] = source.metadata()
        total = sum(m.nbytes for m in metas)
        for round_, seed in enumerate((2, 3), start=1):
            source.inner = ModuleSource(hf_model(seed))
            trainer.send_weights(weight_version=f"rdt-{round_}")
            for r, actor in enumerate(replicas):
                assert generate(actor) == references.outputs(seed), f"replica {r}, round {round_}"
                assert ray.get(actor.get_weight_version.remote(), timeout=60) == f"rdt-{round_}"
        pulled = ray.get([a.collective_rpc.remote(_pulled_bytes) for a in replicas], timeout=60)
        for per_replica in pulled:
            assert 0 < per_replica[0] <= total  # TP 1: the whole model, pulled as slices

        source.inner = FailingSource(hf_model(2), "model.layers.1.mlp.down_proj.weight")
        with pytest.raises(RuntimeError, match="lost the shard"):
            trainer.send_weights()
        for r, actor in enumerate(replicas):
            assert generate(actor) == references.outputs(3), f"replica {r} after the failed sync"

        source.inner = ModuleSource(hf_model(2))
        trainer.send_weights()
        for r, actor in enumerate(replicas):
            assert generate(actor) == references.outputs(2), f"replica {r} after recovery"
    finally:
        trainer.shutdown()


def test_fsdp2_ranks_sync_live_engines_from_their_own_shards(
    cluster: Any, replicas: list[Any], references: References
) -> None:
    """Two FSDP2 ranks (gloo, a Ray actor each) feed both replicas from their local
    shards: no rank gathers (counted), every byte the replicas pull is served once,
    each rank serves about its share, and the engines generate what fresh ones
    loaded from the target checkpoint do. (Every mesh, dim and TP size over
    loopback: `tests/backends/sharded_rdt/test_local_shards.py`.)"""
    from tests.backends.sharded_rdt.ray_parts import FsdpRank
    from wt_kits.group import free_port

    def weights(seed: int) -> Any:  # the tiny Llama's tensors, through Ray's object store
        return ray.put({n: p.detach() for n, p in hf_model(seed).named_parameters()})

    rank_cls = cluster.remote(num_cpus=0)(FsdpRank)
    port = free_port()
    ranks = [rank_cls.remote(r, 2, port, weights(INITIAL_SEED)) for r in range(2)]
    info = dict(
        num_consumers=REPLICAS, num_replicas=REPLICAS, num_trainer_ranks=2, transport="nixl",
        producer_prefix="wt-vllm-rdt-fsdp", timeout_s=120.0, stall_timeout_s=30.0,
        actor_env=LOOPBACK_ENV,
    )  # fmt: skip
    try:
        local = cluster.get(
            [
                r.init.remote(info, engines=replicas if i == 0 else None)
                for i, r in enumerate(ranks)
            ],
            timeout=300,
        )
        assert all(local)
        for seed in (2, 3):
            target = weights(seed)
            cluster.get([r.load.remote(target) for r in ranks], timeout=120)
            results = cluster.get([r.sync.remote() for r in ranks], timeout=300)
            for rank, (counts, _) in enumerate(results):
                assert not [n for n in counts if "gather" in n], f"rank {rank} gathered: {counts}"
            served = [nbytes for _, nbytes in results]
            pulled = sum(
                nbytes
                for per_replica in cluster.get(
                    [a.collective_rpc.remote(_pulled_bytes) for a in replicas], timeout=60
                )
                for nbytes in per_replica
            )
            assert sum(served) == pulled, (served, pulled)  # every byte pulled, served once
            assert max(served) <= 1.5 * pulled / len(ranks), (served, pulled)  # about a share
            for r, actor in enumerate(replicas):
                assert generate(actor) == references.outputs(seed), f"replica {r}, seed {seed}"
        # the counter sees a gather where there is one
        assert all(cluster.get([r.gathers_of_full_tensor.remote() for r in ranks], timeout=60))
    finally:
        cluster.get([r.shutdown.remote() for r in ranks], timeout=60)
        for actor in ranks:
            cluster.kill(actor)


def _pulled_bytes(worker: Any) -> int:
    return int(worker.weight_transfer_engine.pulled_bytes)


@pytest.mark.extended  # a TP-2 engine: three more vLLM processes (slices: test_sharded_loopback)
def test_tensor_parallel_engine_workers_pull_their_halves(
    cluster: Any, tiny_dirs: TinyDirs, references: References, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.envs
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weight_transfer import LocalVLLMWeightSyncClient
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo

    # vLLM's CPU workers bind their threads per NUMA node; this machine has one: bind by hand
    # (vLLM caches its environment once an engine is up: read it afresh)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    vllm.envs.disable_envs_cache()
    kwargs = {**LLM_KWARGS, "distributed_executor_backend": "mp", "tensor_parallel_size": 2}
    llm = LLM(
        model=tiny_dirs[INITIAL_SEED],
        weight_transfer_config=WeightTransferConfig(backend="wt_sharded_rdt"),
        **kwargs,
    )
    try:
        source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
        info = ShardedRDTTrainerInitInfo(
            rank=0,
            num_consumers=2,
            transport="nixl",
            producer_prefix="wt-vllm-rdt-tp2",
            timeout_s=120.0,
            stall_timeout_s=60.0,
            actor_env=LOOPBACK_ENV,
        )
        trainer = ShardedRDTTrainerEngine.trainer_init(
            info, client=LocalVLLMWeightSyncClient(llm), source=source
        )
        try:
            total = sum(m.nbytes for m in source.metadata())

            def outputs() -> Outputs:
                return outputs_of(llm.generate(PROMPTS, sampling_params(), use_tqdm=False))

            before = outputs()
            for seed in (2, 3):
                source.inner = ModuleSource(hf_model(seed))
                trainer.send_weights()
                synced = outputs()
                # the reference: this engine (same sharding, same kernels) loading the
                # target checkpoint itself; a TP-1 engine's logprobs differ in the last bits
                llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": tiny_dirs[seed], "is_checkpoint_format": True},
                )
                assert synced == outputs(), f"seed {seed}: the sync differs from a reload"
                assert [t for t, _ in synced] == [t for t, _ in references.outputs(seed)]
                assert synced != before
                before = synced
                pulled = llm.collective_rpc(_pulled_bytes)
                assert len(pulled) == 2
                for worker, nbytes in enumerate(pulled):
                    assert 0.4 * total < nbytes < 0.6 * total, f"worker {worker} pulled {nbytes}"
        finally:
            trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()
