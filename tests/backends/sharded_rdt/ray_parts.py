"""Ray pieces for `sharded_rdt` over NIXL: a local cluster, consumer actors, their client.

`ray_cluster()` starts a cluster on 127.0.0.1 in its own temporary directory
(`wt_tools.local_ray`: UCX on loopback TCP and shared memory, which NIXL
needs on CPU; every node checked to listen on loopback only). A `Consumer` actor is one
inference worker: a `ShardedModel` shard with a real `ShardedRDTWorkerEngine`
(created through the engine factory, so the entry point is exercised) inside
a `WorkerSession`. `ActorsClient` reaches the workers of one replica, calling
all at once and raising `WeightSyncRPCError` naming the worker that failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from wt_tools.local_ray import LOOPBACK_ENV, local_ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The actors import this checkout (and whatever this process has on its path first).
ACTOR_ENV = {
    **LOOPBACK_ENV,
    "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    "OMP_NUM_THREADS": "1",
}
CALL_TIMEOUT_S = 120.0


@contextlib.contextmanager
def ray_cluster(num_cpus: int = 8) -> Iterator[Any]:
    """A loopback cluster in its own temporary directory (`wt_tools.local_ray`)."""
    temp_dir = tempfile.mkdtemp(prefix="wtrdt")
    try:
        with local_ray(temp_dir, num_cpus, env=ACTOR_ENV) as ray:
            yield ray
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


class Consumer:
    """One inference worker (see the module docstring); wrapped by `ray.remote` in tests."""

    def __init__(self, tp_rank: int, tp: int) -> None:
        from tests.backends.sharded_rdt.models import ShardedModel
        from weight_transfer import (
            WeightTransferConfig,
            WeightTransferEngineFactory,
            WorkerPosition,
            WorkerSession,
        )

        torch.set_num_threads(1)
        self.model = ShardedModel(tp_rank, tp)
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="sharded_rdt"),
            WorkerPosition(tp_rank, tp),
            "cpu",
            self.model,
        )
        self.session = WorkerSession(self.engine)

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.session, method)(*args)

    def state(self) -> tuple[dict[str, torch.Tensor], int, int]:
        """Parameters, bytes pulled in the last sync, this shard's share."""
        params = {n: p.detach().clone() for n, p in self.model.state_dict().items()}
        return params, self.engine.pulled_bytes, self.model.kept_bytes()

    def corrupt(self, name: str | None, at: int = 5) -> int:
        """Flip byte `at` of `name`'s first slice in every pull of it this worker lands,
        before the pull is checked (`weight_transfer.testing.seams`, in this process);
        returns the pull's index. `None` removes the hook."""
        from weight_transfer.testing.seams import install_bucket_hook

        install_bucket_hook(None)  # this worker's process: only this method installs hooks
        if name is None:
            return -1
        plan = self.engine.plan
        chunk = next(c for c in plan.chunks if any(k[0] == name for k in c.keys))
        offset = chunk.offsets[[k[0] for k in chunk.keys].index(name)] + at

        def flip(k: int, buf: torch.Tensor) -> None:
            if k == chunk.index:
                buf[offset] ^= 0xFF

        install_bucket_hook(flip)
        return int(chunk.index)

    def round_open(self) -> bool:
        return bool(self.engine.round_open or self.session.active)

    def end_round(self) -> None:
        """End a round left open, from the host's side (the engine rolls it back)."""
        self.session.abandon_round()


class ActorsClient:
    """The workers of one replica (see the module docstring)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def _all(self, method: str, *args: Any) -> None:
        import ray

        from weight_transfer import WeightSyncRPCError

        refs = [a.call.remote(method, *args) for a in self.actors]
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:  # in completion order: the first failure is the one reported
            done, pending = ray.wait(pending, num_returns=1, timeout=CALL_TIMEOUT_S)
            if not done:
                raise WeightSyncRPCError(method, f"no answer within {CALL_TIMEOUT_S:g}s")
            try:
                ray.get(done[0])
            except Exception as error:
                i = index[done[0]]
                raise WeightSyncRPCError(
                    method, f"worker {i}: {type(error).__name__}: {error}"
                ) from error

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)


class FsdpRank:
    """One FSDP2 trainer rank (wrapped by `ray.remote` in tests): joins a gloo group of
    `world` ranks, holds a module with the names and shapes of `weights` whose every
    leaf module is `fully_shard`ed on dim 0 over a 1-D mesh, and syncs it through
    `sharded_rdt` over NIXL with a `ModuleSource`, counting the collectives each
    sync runs."""

    def __init__(
        self,
        rank: int,
        world: int,
        port: int,
        weights: dict[str, torch.Tensor],
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weight_transfer.testing.models import ConformanceModel

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        self.rank, self.mesh = rank, init_device_mesh("cpu", (world,))
        self.model = ConformanceModel(weights)
        leaves = [m for m in self.model.modules() if list(m.parameters(recurse=False))]
        for module in leaves:
            fully_shard(module, mesh=self.mesh)
        self.engine: Any = None

    def init(self, info: dict[str, Any], engines: list[Any] | None = None) -> bool:
        """`trainer_init` on this rank; the sender (`engines` given: vLLM `LLM` actors)
        reaches them fanned out. Whether it sends local shards."""
        from weight_transfer import FanOutClient, ModuleSource, RayVLLMWeightSyncClient
        from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo

        client = None
        if engines:
            client = FanOutClient([RayVLLMWeightSyncClient(a, timeout=120.0) for a in engines])

        self.engine = ShardedRDTTrainerEngine.trainer_init(
            ShardedRDTTrainerInitInfo(rank=self.rank, **info),
            client=client,
            source=ModuleSource(self.model),
        )
        return bool(self.engine.local)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Set every local shard to torch's own piece of `weights` (the tensors by name):
        `distribute_tensor`, a collective every rank runs, outside any sync."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, tensor in weights.items():
                param = self.model.get_parameter(name)
                piece = distribute_tensor(tensor, self.mesh, param.placements).to_local()
                param.to_local().copy_(piece)

    def sync(self) -> tuple[dict[str, int], int]:
        """One sync: the collectives it ran (by function) and the bytes this rank served."""
        from wt_tools.counting import Collectives

        with Collectives() as counted:
            self.engine.send_weights()
        return dict(counted.counts), int(self.engine.host.describe()["served_bytes"])

    def gathers_of_full_tensor(self) -> int:
        """The all-gathers `Collectives` sees in one `full_tensor()` (the counter's own check)."""
        from wt_tools.counting import Collectives

        with Collectives() as counted:
            next(iter(self.model.parameters())).full_tensor()
        return counted.gathers

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.engine is not None:
            self.engine.shutdown()
        dist.destroy_process_group()
