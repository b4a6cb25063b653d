"""Hardening of wt-nccl's worker: every wait of its handshake is bounded by the
trainer's `timeout_s` (a port that accepts and never answers, a closed port),
and it serves one trainer at a time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import WorkerPool, digest
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from weight_transfer.backend import free_port
from weight_transfer.transport.auth import new_secret
from weight_transfer.transport.wire import WIRE_PROTOCOL_VERSION
from wt_nccl import NCCLTrainerInitInfo


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(5)
    for conn in accepted:  # the worker's abandoned handshake ends here
        conn.close()
    server.close()


def _init(port: int, timeout_s: float) -> dict[str, object]:
    return {
        "wire_protocol": WIRE_PROTOCOL_VERSION,
        "master_address": "127.0.0.1",
        "master_port": port,
        "world_size": 2,
        "timeout_s": timeout_s,
        "secret": new_secret(),
    }


@pytest.mark.parametrize("kind", ["silent", "closed"])
def test_init_against_a_dead_end_fails_within_the_timeout_and_the_worker_stays_usable(
    kind: str, request: pytest.FixtureRequest
) -> None:
    port = request.getfixturevalue("silent_port") if kind == "silent" else free_port()
    with WorkerPool("nccl", 1) as pool:
        client = pool.client(timeout_s=60.0)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncRPCError, match=rf"127\.0\.0\.1:{port}"):
            client.init_weight_transfer_engine(_init(port, timeout_s=3.0))
        elapsed = time.monotonic() - t0
        assert elapsed < 3.0 + 1.5, f"the handshake took {elapsed:.1f}s with timeout_s=3"

        tensors = mixed_tensors(3)
        pool.each("set_names", list(tensors))
        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, timeout_s=30.0)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=pool.client(), source=DictSource(tensors)
        )
        engine.send_weights()
        want = {n: digest(t) for n, t in tensors.items()}
        assert pool.each("digests") == [want]
        engine.shutdown()


def _trainer(pool: WorkerPool, tensors: dict[str, Any], **extra: Any) -> Any:
    info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, timeout_s=60.0, **extra)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=pool.client(), source=DictSource(tensors)
    )


def test_one_trainer_per_engine_unless_the_new_one_replaces_it() -> None:
    tensors = mixed_tensors(4)
    want = {n: digest(t) for n, t in tensors.items()}
    with WorkerPool("nccl", 1, names=list(tensors)) as pool:
        first = _trainer(pool, tensors)
        with pytest.raises(WeightSyncRPCError) as refused:
            _trainer(pool, tensors)
        message = str(refused.value)
        assert f"serves trainer {first.trainer_id}, which is alive" in message
        assert "replace_trainer=True" in message
        first.send_weights()  # the refusal changed nothing for the holder
        assert pool.each("digests") == [want]

        second = _trainer(pool, tensors, replace_trainer=True)
        second.send_weights()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncRPCError, match=f"now serves trainer {second.trainer_id}"):
            first.send_weights()
        assert time.monotonic() - t0 < 5.0  # at once, not after the 60 s timeout
        first.shutdown()
        second.shutdown()

        third = _trainer(pool, tensors)  # the holder shut down: no replace needed
        third.send_weights()
        assert pool.each("digests") == [want]
        third.shutdown()
