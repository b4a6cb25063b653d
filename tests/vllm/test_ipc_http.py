"""`wt_ipc` inside a real vLLM API server process on this host, through
`HTTPVLLMWeightSyncClient`: the handshake and every update are plain JSON (no
insecure-deserialization switch), the server's engine maps this process's
shared memory, and completions keep flowing while it syncs."""

from __future__ import annotations

import glob
import os
import signal
import time
from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    AlteredSource,
    References,
    SwitchSource,
    connect,
    hf_model,
    require_backend,
)
from weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightSyncRPCError

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from tests.vllm.servers import Server, Traffic
from tests.vllm.test_http import start_killable_trainer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKEND = "ipc"


@pytest.fixture(scope="module")
def ipc_server(servers: Any) -> Server:
    require_backend(BACKEND)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
    return servers(BACKEND)[0]


def test_http_ipc_rounds_a_failure_and_syncs_under_traffic(
    ipc_server: Server, references: References, tmp_path: Any
) -> None:
    server = ipc_server
    assert server.generate() == references.outputs(INITIAL_SEED)
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = connect(BACKEND, http, source, str(tmp_path))
    try:
        assert glob.glob(f"/dev/shm/wt-{os.getpid()}-*") == []  # unlinked once attached
        for round_, seed in enumerate((2, 3), start=1):
            source.inner = ModuleSource(hf_model(seed))
            trainer.send_weights(weight_version=f"ipc-{round_}")
            assert server.generate() == references.outputs(seed), f"round {round_}"
            assert server.weight_version() == f"ipc-{round_}"

        down = "model.layers.1.mlp.down_proj.weight"
        bogus = "model.layers.1.mlp.bogus_proj.weight"
        model = hf_model(2)
        source.inner = AlteredSource(model, {down: (bogus, dict(model.named_parameters())[down])})
        with pytest.raises(WeightSyncRPCError, match="bogus_proj"):
            trainer.send_weights(weight_version="never")
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "ipc-2"

        seeds = [2 + i % 2 for i in range(8)]
        with Traffic(server) as traffic:
            while traffic.done < 3 and not traffic.failures:
                time.sleep(0.05)
            for round_, seed in enumerate(seeds, start=1):
                source.inner = ModuleSource(hf_model(seed))
                trainer.send_weights(weight_version=f"ipc-traffic-{round_}")
                time.sleep(0.05)
        assert traffic.failures == []
        assert traffic.done >= 8, traffic.done
        assert server.generate() == references.outputs(seeds[-1])
        assert server.weight_version() == f"ipc-traffic-{len(seeds)}"
    finally:
        trainer.shutdown()
        http.close()
    # vLLM's examples/rl/rlhf_http_ipc.py as its users port it (two imports, the
    # backend name): the factory with `IPCTrainerInitInfo(rank=0, packed=False)` (its
    # default buffer, no worker count), the server's own /pause and /resume around
    from weight_transfer import WeightTransferTrainerFactory
    from wt_ipc import IPCTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=IPCTrainerInitInfo(rank=0, packed=False),
        client=HTTPVLLMWeightSyncClient(server.url),
        source=ModuleSource(hf_model(2)),
    )
    try:
        server.http.post("/pause").raise_for_status()
        engine.send_weights()
        server.http.post("/resume").raise_for_status()
        assert server.generate() == references.outputs(2)
    finally:
        engine.shutdown()


def _engine_processes(pid: int) -> list[int]:
    """The vLLM engine processes (`VLLM::EngineCore`, `VLLM::Worker`) below `pid`."""
    found = []
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline") as f:
                if f.read().startswith("VLLM::"):
                    found.append(child)
        except FileNotFoundError:
            continue
    return found


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(task) as f:
            for child in f.read().split():
                out += [int(child), *_descendants(int(child))]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_ends_a_worker_stuck_in_a_round_and_leaves_no_shared_memory(
    ipc_server: Server, tmp_path: Any
) -> None:
    """Last in this module: it stops the server. The worker waits for a bucket of
    a trainer that stalls; SIGTERM to the server's process group ends the engine
    processes within seconds, and nothing of wt's is left in /dev/shm. (vLLM's
    HTTP front end then still waits for the open `/update_weights` request, a
    front-end matter; the test kills it.)"""
    import torch

    server = ipc_server
    state_path = tmp_path / "seed3.pt"
    torch.save({n: p.detach() for n, p in hf_model(3).named_parameters()}, state_path)
    trainer = start_killable_trainer(server.url, BACKEND, str(state_path))
    try:
        time.sleep(1.0)  # the worker now waits for the next bucket
        engines = _engine_processes(server.proc.pid)
        assert engines, "the server started no engine process"
        os.killpg(server.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        while any(_alive(pid) for pid in engines) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        print(f"the engine processes exited {elapsed:.1f}s after SIGTERM")
        assert not any(_alive(pid) for pid in engines), "an engine process ignored SIGTERM"
        assert elapsed < 15, f"the engine processes took {elapsed:.1f}s to exit"
        for pid in [trainer.pid, server.proc.pid, *engines]:
            assert glob.glob(f"/dev/shm/wt-{pid}-*") == []
    finally:
        trainer.kill()
        trainer.wait(10)
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
