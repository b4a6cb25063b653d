"""`wt_ipc` re-admits a restarted vLLM API server at the next `send_weights`.

The server (its front end and engine) is killed with SIGKILL and started again on
its port; the trainer, still running, attaches the new engine to a fresh staging
at its next sync (no `trainer_init`), which then serves tokens equal to a fresh
engine's, and nothing of wt's is left in /dev/shm.
"""

from __future__ import annotations

import glob
import os
import signal
from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    References,
    SwitchSource,
    TinyDirs,
    VersionedClient,
    connect,
    hf_model,
    require_backend,
)
from weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from tests.vllm.test_http import Server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKEND = "ipc"


def _restarted(server: Server) -> Server:
    """`server` killed (SIGKILL to its process group) and started again on its port."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    server.stop()
    fresh = Server(server.model_dir, server.log_path, backend=BACKEND, port=server.port)
    fresh.wait_ready()
    return fresh


def test_a_restarted_server_is_readmitted_at_the_next_sync(
    tiny_dirs: TinyDirs, references: References, tmp_path: Any
) -> None:
    require_backend(BACKEND)
    server = Server(tiny_dirs[INITIAL_SEED], str(tmp_path / "server.log"), backend=BACKEND)
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = None
    try:
        server.wait_ready()
        trainer = connect(BACKEND, client, source, str(tmp_path))
        source.inner = ModuleSource(hf_model(2))
        client.version = "before-restart"
        trainer.send_weights()
        assert server.generate() == references.outputs(2)

        server = _restarted(server)
        assert server.generate() == references.outputs(INITIAL_SEED)  # a fresh engine
        source.inner = ModuleSource(hf_model(3))
        client.version = "after-restart"
        trainer.send_weights()  # attaches the new engine, then syncs it
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "after-restart"
        assert glob.glob(f"/dev/shm/wt-{os.getpid()}-*") == []
    finally:
        if trainer is not None:
            trainer.shutdown()
        http.close()
        server.stop()
