"""The private group's rendezvous admits only workers that prove the engine's secret.

Every stray is a real OS process on 127.0.0.1 (`tests/stray.py`); every legit
worker is a spawned process joining through `StatelessGroup.create`. A stray
that stays silent, claims a rank without the secret or plays trainer neither
joins, nor stalls the group, nor gets a worker to join it; both sides log the
refusal. The store listens on the given address only, and the port can be
bound again as soon as the group closed.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import ForbiddenClient
from tests.stray import Stray
from weight_transfer.backend import WorkerPosition, parse_payload, payload_of
from weight_transfer.payload import WIRE_PROTOCOL_VERSION
from weight_transfer.runtime.waiting import in_background
from wt_kits.group import (
    GroupInitInfo,
    GroupTrainerFields,
    StatelessGroup,
    free_port,
    join_group,
    trainer_rendezvous,
)
from wt_kits.group.auth import new_secret
from wt_kits.group.store import StoreRefused, StoreServer, connect_store

HOST = "127.0.0.1"
TRAINER = "trainer-under-test"
NBYTES = 1 << 16
WAIT_S = 60.0


def _worker(port: int, secret: str, rank: int, world_size: int, nbytes: int, out: Any) -> None:
    """A legit worker process: join, receive one broadcast, report its sha256 (or the error)."""
    torch.set_num_threads(1)
    try:
        group = StatelessGroup.create(
            host=HOST, port=port, rank=rank, world_size=world_size, secret=secret,
            trainer_id=TRAINER, timeout_s=30.0,
        )  # fmt: skip
        out.send(("joined", rank))
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        group.wait(group.broadcast(buffer), "the test broadcast")
        out.send(("bytes", hashlib.sha256(buffer.numpy().tobytes()).hexdigest()))
        group.close()
    except Exception as e:
        out.send(("error", f"{type(e).__name__}: {e}"))


class Worker:
    """A spawned `_worker`; `result(kind)` waits (bounded) for its next report."""

    def __init__(self, port: int, secret: str, rank: int = 1, world_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(port, secret, rank, world_size, NBYTES, child), daemon=True
        )
        self.proc.start()
        child.close()

    def result(self, kind: str, timeout_s: float = WAIT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"the worker reported nothing within {timeout_s:g}s")
        got, value = self.conn.recv()
        assert got == kind, f"the worker reported {got}: {value}"
        return value

    def stop(self) -> None:
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def _host(port: int, secret: str, world_size: int = 2) -> Future[StatelessGroup]:
    """Rank 0's side of a rendezvous, on a daemon thread."""
    return in_background(
        lambda: StatelessGroup.create(
            host=HOST,
            port=port,
            rank=0,
            world_size=world_size,
            secret=secret,
            trainer_id=TRAINER,
            timeout_s=30.0,
        ),
        name="test-rendezvous",
    )


def _broadcast_exact(group: StatelessGroup, worker: Worker) -> None:
    """Rank 0 broadcasts random bytes; the worker must hold exactly them."""
    payload = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
    group.wait(group.broadcast(payload), "the test broadcast")
    assert worker.result("bytes") == hashlib.sha256(payload.numpy().tobytes()).hexdigest()


@pytest.fixture
def worker_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    yield caplog


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "weight_transfer" and r.levelno == logging.WARNING
    ]


def _wait_logged(caplog: pytest.LogCaptureFixture, needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hits = [m for m in _refusals(caplog) if needle in m]
        if hits:
            return hits[0]
        time.sleep(0.05)
    raise AssertionError(f"nothing logged with {needle!r}: {_refusals(caplog)}")


# ------------------------------------------------------------------ strays on the trainer's port


def test_a_silent_stray_does_not_stall_the_rendezvous() -> None:
    port, secret = free_port(), new_secret()
    joining = _host(port, secret)
    with Stray("silent", HOST, port, 30) as stray:
        stray.line("connected")
        t0 = time.monotonic()
        worker = Worker(port, secret)
        try:
            group = joining.result(WAIT_S)
            elapsed = time.monotonic() - t0
            assert worker.result("joined") == 1
            # well inside the 10 s the stray's handshake may still take
            assert elapsed < 8.0, f"the rendezvous took {elapsed:.1f}s beside a silent stray"
            _broadcast_exact(group, worker)
            assert group.server is not None and group.server.admitted == {1}
            group.close()
        finally:
            worker.stop()


def test_a_flood_of_silent_connections_delays_a_worker_but_cannot_keep_it_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every handshake slot held by a stray for 6 s (each one it loses at the 2 s
    deadline is taken again at once): the worker is told BUSY, retries, and
    joins once the flood ends."""
    from wt_kits.group import stateless as group_module
    from wt_kits.group import store as store_module

    monkeypatch.setattr(store_module, "MAX_PENDING_HANDSHAKES", 4)
    monkeypatch.setattr(group_module, "HANDSHAKE_TIMEOUT_S", 2.0)
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    port, secret = free_port(), new_secret()
    joining = _host(port, secret)
    with Stray("flood", HOST, port, 4, 6) as stray:
        assert stray.line("flooding") == "4"
        t0 = time.monotonic()
        worker = Worker(port, secret)
        try:
            group = joining.result(WAIT_S)
            elapsed = time.monotonic() - t0
            assert worker.result("joined") == 1
            assert elapsed < 20.0, f"the worker joined after {elapsed:.1f}s"
            _broadcast_exact(group, worker)
            group.close()
        finally:
            worker.stop()
    refusals = [r.getMessage() for r in caplog.records]
    assert any("too many handshakes in progress" in m for m in refusals), refusals
    assert any("handshake timeout" in m for m in refusals), refusals


def test_a_silent_stray_is_dropped_at_the_handshake_deadline_and_logged(
    worker_log: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    server = StoreServer(
        HOST, port, secret=new_secret(), trainer_id=TRAINER, world_size=2, handshake_timeout_s=0.5
    )
    try:
        with Stray("silent", HOST, port, 30) as stray:
            peer = stray.line("connected")
            message = _wait_logged(worker_log, "handshake timeout")
            assert peer in message and f"{HOST}:{port}" in message
    finally:
        server.close()


def test_a_stray_claiming_a_rank_without_the_secret_is_refused_and_logged(
    worker_log: pytest.LogCaptureFixture,
) -> None:
    port, secret = free_port(), new_secret()
    joining = _host(port, secret)
    with Stray("claim", HOST, port, 1) as stray:
        peer = stray.line("connected")
        assert stray.line("verdict").startswith("01")  # refused
        assert stray.line("after") == "CLOSED"  # and its forged request went nowhere
    message = _wait_logged(worker_log, "bad secret")
    assert peer in message and "claimed rank 1" in message
    assert all(secret not in m for m in _refusals(worker_log))

    worker = Worker(port, secret)  # the rank the stray claimed is still free
    try:
        group = joining.result(WAIT_S)
        assert worker.result("joined") == 1
        _broadcast_exact(group, worker)

        # a second admission of rank 1, even with the secret, is refused (and logged)
        with pytest.raises(StoreRefused, match=rf"{HOST}:{port}.*rank 1 has already joined"):
            connect_store(HOST, port, secret=secret, trainer_id=TRAINER, rank=1, timeout_s=5.0)
        _wait_logged(worker_log, "rank 1 has already joined")
        group.close()
    finally:
        worker.stop()


# ------------------------------------------------------------------ a stray in the trainer's place


def test_a_worker_refuses_a_stray_server_logs_it_and_joins_nothing(
    worker_log: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    info = parse_payload(
        GroupInitInfo,
        {
            "wire_protocol": WIRE_PROTOCOL_VERSION,
            **GroupTrainerFields(HOST, port, 2, timeout_s=10.0).worker_group_fields(TRAINER),
        },
        "init_info",
    )
    with Stray("server", HOST, port) as stray:
        stray.line("listening")
        t0 = time.monotonic()
        with pytest.raises(StoreRefused, match=rf"{HOST}:{port}.*did not prove") as refused:
            join_group(info, WorkerPosition(0, 1), "cpu")
        assert time.monotonic() - t0 < 5.0
        assert stray.line("no-proof", timeout_s=10.0) == ""  # it learnt no worker proof
    assert info.secret not in str(refused.value)
    message = _wait_logged(worker_log, "refused the store")
    assert f"{HOST}:{port}" in message and info.secret not in message


# ------------------------------------------------------------------ the listening socket


def test_the_store_listens_on_the_given_address_only() -> None:
    port = free_port()
    group = StatelessGroup.create(host=HOST, port=port, rank=0, world_size=1, secret=new_secret())
    try:
        assert group.server is not None
        assert group.server.address == (HOST, port)
        assert group.server._listener.getsockname() == (HOST, port)
        # 127.0.0.2 is this host's loopback too: nothing listens there for this port
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=2.0).close()
    finally:
        group.close()


def test_a_second_rendezvous_binds_the_same_port_right_after_the_first_closed() -> None:
    port = free_port()
    for round_ in range(2):
        secret = new_secret()  # one per rendezvous
        joining = _host(port, secret)
        worker = Worker(port, secret)
        try:
            group = joining.result(WAIT_S)
            assert worker.result("joined") == 1, f"rendezvous {round_}"
            _broadcast_exact(group, worker)
            group.close()  # the listening socket closes here, at once
        finally:
            worker.stop()
    with pytest.raises(ConnectionRefusedError):  # nothing is left listening
        socket.create_connection((HOST, port), timeout=2.0).close()


def test_the_store_serves_every_request_bounded_and_the_worker_sees_it_close() -> None:
    port, secret = free_port(), new_secret()
    server = StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=2)
    store = connect_store(HOST, port, secret=secret, trainer_id=TRAINER, rank=1, timeout_s=10)
    try:
        server.store.set("open", "1")
        assert store.check(["open"]) and store.get("open") == b"1"
        store.set("k", b"v")
        assert server.store.get("k") == b"v"
        assert store.add("n", 2) == 2 and server.store.add("n", 3) == 5
        assert store.compare_set("c", b"", b"x") == b"x"
        assert store.compare_set("c", b"y", b"z") == b"x"
        assert store.num_keys() == 4
        assert store.delete_key("k") and not store.check(["k"])

        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="'late'"):
            store.wait(["late"], timedelta(seconds=0.3))
        assert time.monotonic() - t0 < 2.0
        threading.Timer(0.3, lambda: server.store.set("late", b"1")).start()
        store.wait(["late"], timedelta(seconds=10))  # across several server-side slices

        server.close()
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=f"{HOST}:{port}"):
            store.check(["open"])
        assert time.monotonic() - t0 < 2.0
    finally:
        store.close()
        server.close()


# ------------------------------------------------------------------ the secret in the handshake


def test_the_secret_is_required_and_never_shown() -> None:
    fields = GroupTrainerFields(HOST, 29500, 2).worker_group_fields(TRAINER)
    again = GroupTrainerFields(HOST, 29500, 2).worker_group_fields(TRAINER)
    assert len(fields["secret"]) == 64 and fields["secret"] != again["secret"]
    assert GroupTrainerFields(HOST, 29500, 2).worker_group_fields(TRAINER, "s" * 40)["secret"] == (
        "s" * 40
    )
    base = {"wire_protocol": WIRE_PROTOCOL_VERSION, **fields}
    info = parse_payload(GroupInitInfo, base, "init_info")
    assert fields["secret"] not in repr(info)
    assert payload_of(info)["secret"] == fields["secret"]
    for bad in ({k: v for k, v in base.items() if k != "secret"}, {**base, "secret": ""}):
        with pytest.raises(ValueError, match="field 'secret'"):
            parse_payload(GroupInitInfo, bad, "init_info")
    with pytest.raises(ValueError, match="field 'secret'"):
        parse_payload(GroupInitInfo, {**base, "secret": "short"}, "init_info")
    with pytest.raises(ValueError, match="field 'secret'"):
        StatelessGroup.create(host=HOST, port=free_port(), rank=0, world_size=1, secret="")
    with pytest.raises(ValueError, match="field 'secret'"):  # before any call reaches a worker
        trainer_rendezvous(
            ForbiddenClient(),  # type: ignore[arg-type]
            {k: v for k, v in base.items() if k != "secret"},
            GroupTrainerFields(HOST, free_port(), 2),
        )
