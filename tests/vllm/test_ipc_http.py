"""`wt_ipc` inside a real vLLM API server process on this host, through
`HTTPVLLMWeightSyncClient`: the handshake and every update are plain JSON (no
insecure-deserialization switch), the server's engine maps this process's
shared memory, and completions keep flowing while it syncs."""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    AlteredSource,
    References,
    SwitchSource,
    TinyDirs,
    VersionedClient,
    connect,
    hf_model,
    require_backend,
)
from weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightSyncRPCError

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from tests.vllm.test_http import (
    KILL_POINTS,
    Server,
    Traffic,
    kill_trainers_at_every_point,
    start_killable_trainer,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKEND = "ipc"


@pytest.fixture(scope="module")
def ipc_server(tiny_dirs: TinyDirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_backend(BACKEND)
    log = tmp_path_factory.mktemp("ipc-http-server") / "server.log"
    srv = Server(tiny_dirs[INITIAL_SEED], str(log), backend=BACKEND)
    try:
        srv.wait_ready()
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
        yield srv
    finally:
        srv.stop()


def test_http_ipc_rounds_a_failure_and_syncs_under_traffic(
    ipc_server: Server, references: References, tmp_path: Any
) -> None:
    server = ipc_server
    assert server.generate() == references.outputs(INITIAL_SEED)
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = connect(BACKEND, client, source, str(tmp_path))
    try:
        assert glob.glob(f"/dev/shm/wt-{os.getpid()}-*") == []  # unlinked once attached
        for round_, seed in enumerate((2, 3), start=1):
            source.inner = ModuleSource(hf_model(seed))
            client.version = f"ipc-{round_}"
            trainer.send_weights()
            assert server.generate() == references.outputs(seed), f"round {round_}"
            assert server.weight_version() == f"ipc-{round_}"

        down = "model.layers.1.mlp.down_proj.weight"
        bogus = "model.layers.1.mlp.bogus_proj.weight"
        model = hf_model(2)
        source.inner = AlteredSource(model, {down: (bogus, dict(model.named_parameters())[down])})
        client.version = "never"
        with pytest.raises(WeightSyncRPCError, match="bogus_proj"):
            trainer.send_weights()
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "ipc-2"

        seeds = [2 + i % 2 for i in range(8)]
        with Traffic(server) as traffic:
            while traffic.done < 3 and not traffic.failures:
                time.sleep(0.05)
            for round_, seed in enumerate(seeds, start=1):
                source.inner = ModuleSource(hf_model(seed))
                client.version = f"ipc-traffic-{round_}"
                trainer.send_weights()
                time.sleep(0.05)
        assert traffic.failures == []
        assert traffic.done >= 8, traffic.done
        assert server.generate() == references.outputs(seeds[-1])
        assert server.weight_version() == f"ipc-traffic-{len(seeds)}"
    finally:
        trainer.shutdown()
        http.close()


def test_http_ipc_a_trainer_killed_at_any_point_of_a_sync_never_leaves_the_server_paused(
    ipc_server: Server, references: References, tmp_path: Any
) -> None:
    points = tuple(p for p in KILL_POINTS if p != "fleet-held")  # one replica: no fleet
    kill_trainers_at_every_point(ipc_server, references, BACKEND, tmp_path, points)


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


def test_a_restarted_server_is_readmitted_at_the_next_sync(
    ipc_server: Server, references: References, tmp_path: Any
) -> None:
    """The server (front end and engine) is killed with SIGKILL and started again on its
    port; the trainer, still running, attaches the new engine to a fresh staging at its
    next sync (no `trainer_init`), which then serves tokens equal to a fresh engine's,
    and nothing of wt's is left in /dev/shm."""
    server = ipc_server
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = connect(BACKEND, client, source, str(tmp_path))
    try:
        source.inner = ModuleSource(hf_model(2))
        client.version = "before-restart"
        trainer.send_weights()
        assert server.generate() == references.outputs(2)

        server.restart()
        assert server.generate() == references.outputs(INITIAL_SEED)  # a fresh engine
        source.inner = ModuleSource(hf_model(3))
        client.version = "after-restart"
        trainer.send_weights()  # attaches the new engine, then syncs it
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "after-restart"
        assert glob.glob(f"/dev/shm/wt-{os.getpid()}-*") == []
    finally:
        trainer.shutdown()
        http.close()


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
