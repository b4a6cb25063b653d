"""`ModuleSource` over a real DTensor module sharded across 2 gloo processes on CPU.

`metadata()` must report global shapes without a collective (counted with
`CommDebugMode`, and called on rank 0 alone); iteration must all-gather each
parameter into a plain tensor equal bit for bit to the unsharded original.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from datetime import timedelta
from typing import Any

import torch

from tests.harness import digest
from wt_kits.group.stateless import free_port

WORLD = 2
TIMEOUT_S = 60.0


def build_model() -> torch.nn.Module:
    """Uneven shard sizes on purpose: 7 and 1 rows split over 2 ranks, an int64 parameter."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1))
    m[1].to(torch.bfloat16)
    m.register_parameter(
        "steps", torch.nn.Parameter(torch.arange(9, dtype=torch.int64) * 3, requires_grad=False)
    )
    return m


def _rank_main(rank: int, port: int, results: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from weight_transfer import ModuleSource

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=20),
        )
        mesh = init_device_mesh("cpu", (WORLD,))
        model = build_model()
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                sharded = distribute_tensor(p.detach(), mesh, [Shard(0)])
                mod.register_parameter(
                    name, torch.nn.Parameter(sharded, requires_grad=p.requires_grad)
                )
        local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        all_dtensors = all(isinstance(p, DTensor) for p in model.parameters())
        source = ModuleSource(model)

        solo_meta = None
        if rank == 0:  # a gathering metadata() would block here, alone
            solo_meta = [(m.name, str(m.dtype), m.shape) for m in source.metadata()]
        dist.barrier()
        with CommDebugMode() as comm:
            metas = [(m.name, str(m.dtype), m.shape) for m in source.metadata()]
        meta_comms = comm.get_total_counts()

        passes = []
        with CommDebugMode() as comm:
            for _ in range(2):
                out = list(source)
                passes.append([(n, type(t) is torch.Tensor, digest(t)) for n, t in out])
        iter_comms = comm.get_total_counts()
        dist.barrier()
        dist.destroy_process_group()
        results.put(
            (
                rank,
                {
                    "all_dtensors": all_dtensors,
                    "local_shapes": local_shapes,
                    "solo_meta": solo_meta,
                    "metas": metas,
                    "meta_comms": meta_comms,
                    "passes": passes,
                    "iter_comms": iter_comms,
                },
            )
        )
    except BaseException as e:
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def test_module_source_over_dtensor_module() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, results), daemon=True) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        got: dict[int, dict[str, Any]] = {}
        for _ in range(WORLD):
            try:
                rank, res = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(WORLD)) - set(got))} hung") from None
            got[rank] = res
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank in range(WORLD):
        assert "error" not in got[rank], got[rank]

    reference = build_model()
    expected_meta = [(n, str(p.dtype), tuple(p.shape)) for n, p in reference.named_parameters()]
    expected_pass = [(n, True, digest(p.detach())) for n, p in reference.named_parameters()]
    assert got[0]["solo_meta"] == expected_meta
    for rank in range(WORLD):
        r = got[rank]
        assert r["all_dtensors"]
        # really sharded: rank 0 holds 4 of 7 rows, rank 1 holds 3 (and 0 of the 1-row bias)
        assert r["local_shapes"]["0.weight"] == ((4, 5) if rank == 0 else (3, 5))
        assert r["local_shapes"]["1.bias"] == ((1,) if rank == 0 else (0,))
        assert r["metas"] == expected_meta
        assert r["meta_comms"] == 0
        assert r["iter_comms"] >= 2 * len(expected_meta)  # one all-gather per parameter per pass
        assert r["passes"] == [expected_pass, expected_pass]
