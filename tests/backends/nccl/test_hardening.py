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
from weight_transfer.payload import WIRE_PROTOCOL_VERSION
from wt_kits.group import free_port
from wt_kits.group.auth import new_secret
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


class _Relay:
    """Forwards to `inner`, rewriting each round's update info with `rewrite`. With
    `key` (a faulty control plane that read the init payload, which carries the
    trainer's key) it signs the altered payload again; without, the payload keeps
    the trainer's signature, as a relay or an HTTP caller without the key must."""

    def __init__(self, inner: Any, rewrite: Any) -> None:
        self.inner = inner
        self.rewrite = rewrite
        self.key: Any = None
        self.inits = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inits += 1
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        if "names" in update_info and self.rewrite is not None:
            update_info = self.rewrite(dict(update_info))
            if self.key is not None:
                update_info = self.key.sign(update_info)
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


def _transposed(payload: dict[str, Any]) -> dict[str, Any]:
    """The first 2-D tensor declared transposed: the same bytes, another layout."""
    shapes = [list(s) for s in payload["shapes"]]
    i = next(i for i, s in enumerate(shapes) if len(s) == 2 and s[0] != s[1])
    shapes[i] = shapes[i][::-1]
    return {**payload, "shapes": shapes}


def _narrowed(payload: dict[str, Any]) -> dict[str, Any]:
    """The first float32 tensor declared bfloat16: every later offset moves."""
    dtypes = list(payload["dtype_names"])
    dtypes[dtypes.index("float32")] = "bfloat16"
    return {**payload, "dtype_names": dtypes}


def _renamed(payload: dict[str, Any]) -> dict[str, Any]:
    names = list(payload["names"])
    names[-1] = "lm_head.bias"
    return {**payload, "names": names}


@pytest.fixture(scope="module")
def one_worker() -> Iterator[WorkerPool]:
    """One worker, shared: each test connects its own trainer and shuts it down."""
    with WorkerPool("nccl", 1, names=list(mixed_tensors(11))) as pool:
        yield pool


@pytest.mark.parametrize(
    ("rewrite", "field"),
    [(_transposed, "shapes"), (_narrowed, "dtype_names"), (_renamed, "names")],
    ids=["transposed", "narrowed", "renamed"],
)
def test_an_update_rewritten_on_its_way_is_refused_naming_the_field_and_changes_nothing(
    one_worker: WorkerPool, rewrite: Any, field: str
) -> None:
    """Without the key the signature fails; with it (a faulty control plane), the
    trainer's header on the wire does not match: either way the worker refuses before
    it sizes a receive (a wrong size used to abort its process), keeps its weights,
    and the group carries the next round as it is."""
    first, second = mixed_tensors(11), mixed_tensors(12)
    pool = one_worker
    relay = _Relay(pool.client(), None)
    info = NCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 2, rank=0, timeout_s=60.0, packed_buffer_size_bytes=2048
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=relay, source=DictSource(first))
    engine.send_weights()
    want = {n: digest(t) for n, t in first.items()}

    engine.source = DictSource(second)
    relay.rewrite = rewrite
    t0 = time.monotonic()
    with pytest.raises(WeightSyncRPCError, match="field 'wt_auth' does not prove"):
        engine.send_weights()  # signed by the trainer, altered on its way
    assert time.monotonic() - t0 < 10.0  # not the 60 s timeout
    assert pool.each("digests") == [want]
    # The worker refused before it touched the wire, the trainer's broadcast failed:
    # the next round re-forms the group first.

    relay.key = engine.client.control
    t0 = time.monotonic()
    with pytest.raises(WeightSyncRPCError, match=f"field '{field}' differs from the"):
        engine.send_weights()  # signed again with the trainer's key
    assert time.monotonic() - t0 < 10.0
    assert pool.each("digests") == [want]  # the worker is alive and kept its weights
    group, inits = engine.channel.group, relay.inits

    relay.rewrite = None
    engine.send_weights()
    assert pool.each("digests") == [{n: digest(t) for n, t in second.items()}]
    assert (engine.channel.group, relay.inits) == (group, inits)  # drained: still in step
    engine.shutdown()
