"""The rendezvous store after the handshake: every frame checked, every session frame authentic.

An admitted but misbehaving peer (a real OS process holding the secret,
`tests/stray.py admitted`) sends crafted frames: each is refused, logged at
WARNING naming the peer, its rank and the field, answered DROPPED and its
connection closed; no connection thread dies, and the store keeps serving an
honest worker and forms a gloo group afterwards. A relay (a real OS process
forwarding a worker's connection on 127.0.0.1, `tests/stray.py relay`) that
rewrites, replays, reflects, splices or drops a frame is refused by the side
that receives it, and the trainer's store never holds what the relay wrote;
an honest relay carries a real group end to end.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.core.test_rendezvous_auth import (
    HOST,
    TRAINER,
    Worker,
    _broadcast_exact,
    _host,
    _refusals,
    _wait_logged,
)
from tests.stray import Stray
from weight_transfer.runtime.waiting import in_background
from wt_kits.group import StatelessGroup, free_port
from wt_kits.group import stateless as group_module
from wt_kits.group import store as store_module
from wt_kits.group.auth import new_secret
from wt_kits.group.store import RemoteStore, StoreServer, connect_store

WAIT_S = 60.0

# case of `tests/stray.py admitted` -> what the store's refusal must name
MALFORMED = {
    "wait-overflow": "field 'wait_ms' of wait: b'1000000000000000'... (4001 bytes)",
    "get-overflow": "field 'wait_ms' of get",
    "wait-negative": "field 'wait_ms' of wait: b'-1' is not a decimal integer in [0, 500]",
    "wait-too-long": "field 'wait_ms' of wait: b'3600000'",
    "wait-not-decimal": "field 'wait_ms' of wait: b' 1_0'",
    "wait-no-fields": "field count of wait",
    "add-past-64-bits": "field 'amount' of add: b'9223372036854775808'",
    "add-overflow": "field 'amount' of add",
    "op-unknown": "field 'op': unknown op 99",
    "op-zero": "field 'op': unknown op 0",
    "body-empty": "field 'op': an empty frame",
    "set-three-fields": "field count of set: 3 fields where 2 are due",
    "num-keys-one-field": "field count of num_keys",
    "check-too-many-fields": "field count: more than 4096 fields",
    "field-length-negative": "field 0: its length declares 4294967295 bytes",
    "field-length-cut": "field 0: its length is cut off",
    "key-not-utf8": "field 'key' of set: b'\\xff\\xfe' is not UTF-8",
    "key-too-long": "field 'key' of set: a 4097-byte key",
    "frame-length-negative": "the frame length declares 4294967295 bytes",
    "frame-length-huge": "the frame length declares 1048601 bytes",
    "frame-cut": "the connection closed 10 bytes into a 100-byte frame",
    "frame-short": "a 5-byte session frame",
    "tag-forged": "failed authentication (frame 0 failed its tag",
    "seq-skipped": "failed authentication (frame number 1 came where 0 was due",
    "seq-replayed": "failed authentication (frame number 0 came where 1 was due",
    "seq-reordered": "failed authentication (frame number 1 came where 0 was due",
    "reflected": "failed authentication (frame 0 failed its tag",
}


@pytest.fixture
def thread_deaths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every exception that ends a thread of this process (the store's included)."""
    deaths: list[str] = []

    def record(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread else "?"
        deaths.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")

    monkeypatch.setattr(threading, "excepthook", record)
    yield deaths


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    return caplog


def _assert_no_thread_failed(deaths: list[str], caplog: pytest.LogCaptureFixture) -> None:
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not deaths, f"threads died: {deaths}"
    assert not errors, f"a connection's thread failed: {errors}"


def _wait_until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g}s")
        time.sleep(0.02)


# ------------------------------------------------------------------ a gloo group over a bare server

GROUP = "after-faults"
NBYTES = 1 << 16


def _gloo(store: dist.Store, rank: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(dist.PrefixStore(GROUP, store), rank, 2, opts)


def _gloo_worker(port: int, secret: str, store_rank: int, out: Any) -> None:
    """Join the store as `store_rank`, then be rank 1 of a 2-rank gloo group over it."""
    torch.set_num_threads(1)
    try:
        store = connect_store(
            HOST, port, secret=secret, trainer_id=TRAINER, rank=store_rank, timeout_s=30.0
        )
        pg = _gloo(store, 1)
        buffer = torch.zeros(NBYTES, dtype=torch.uint8)
        pg.broadcast([buffer]).wait()
        out.send(("bytes", hashlib.sha256(buffer.numpy().tobytes()).hexdigest()))
    except Exception as e:
        out.send(("error", f"{type(e).__name__}: {e}"))


def _group_forms_over(server: StoreServer, port: int, secret: str, store_rank: int) -> None:
    """A worker process and this process form a gloo group over `server`; the
    broadcast arrives bit-exact."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_gloo_worker, args=(port, secret, store_rank, child), daemon=True)
    proc.start()
    child.close()
    try:
        pg = _gloo(server.store, 0)
        payload = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
        pg.broadcast([payload]).wait()
        assert conn.poll(WAIT_S), "the gloo worker reported nothing"
        kind, value = conn.recv()
        assert kind == "bytes", value
        assert value == hashlib.sha256(payload.numpy().tobytes()).hexdigest()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


# ------------------------------------------------------------------ an admitted, misbehaving peer


def _misbehave(port: int, secret: str, rank: int, case: str) -> tuple[str, list[str]]:
    """Run `admitted` case `case` as `rank`: its address and the answers it got before the
    store closed the connection."""
    with Stray("admitted", HOST, port, rank, case, secret=secret, trainer_id=TRAINER) as stray:
        peer = stray.line("connected")
        stray.line("admitted")
        stray.line("sent")
        lines = stray.until("closed")
    assert all(line.startswith("answer ") for line in lines), (case, lines)
    return peer, [line[len("answer ") :] for line in lines]


def test_an_admitted_peer_sending_malformed_frames_is_refused_by_field_and_the_store_serves_on(
    log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    port, secret = free_port(), new_secret()
    world_size = len(MALFORMED) + 3  # a rank per case, an honest worker, a gloo worker
    honest_rank, gloo_rank = world_size - 2, world_size - 1
    server = StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=world_size)
    honest = connect_store(
        HOST, port, secret=secret, trainer_id=TRAINER, rank=honest_rank, timeout_s=10
    )
    try:
        for rank, (case, field) in enumerate(MALFORMED.items(), start=1):
            peer, answers = _misbehave(port, secret, rank, case)
            # the store's last word names the field, tagged (the stray checked the tag)
            assert answers and answers[-1].startswith("03 "), (case, answers)
            assert field in answers[-1], (case, answers[-1])
            assert all(a.startswith("00 ") for a in answers[:-1]), (case, answers)
            message = _wait_logged(log, f"refused {peer}:")
            assert f"rank {rank} sent a frame that" in message, message
            assert field in message and "dropped the connection" in message, (case, message)
            # the honest worker is served between every two faults
            honest.set(f"after/{case}", case)
            assert honest.get(f"after/{case}") == case.encode()
            _wait_until(lambda: server.connections == 1, f"{case}: its connection was not closed")
        assert server.admitted == set(range(1, len(MALFORMED) + 1)) | {honest_rank}

        honest.wait([f"after/{case}" for case in MALFORMED], timedelta(seconds=5))
        assert honest.add("counter", 5) == 5 and server.store.add("counter", -2) == 3
        _group_forms_over(server, port, secret, gloo_rank)
    finally:
        honest.close()
        server.close()
    _assert_no_thread_failed(thread_deaths, log)


def test_a_sum_past_64_bits_is_answered_error_and_the_connection_stays(
    log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    port, secret = free_port(), new_secret()
    server = StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=2)
    try:
        with Stray("admitted", HOST, port, 1, "add-wraps", secret=secret, trainer_id=TRAINER) as s:
            s.line("sent")
            answers = s.until("open")  # the connection stays after the refused add
        assert answers == [
            "answer 00",
            "answer 02 adding 1 to key 'n' leaves the 64-bit range",
            "answer 00 1",
        ]
        assert server.store.get("n") == b"9223372036854775807"  # left as it was
        _wait_logged(log, "leaves the 64-bit range")
    finally:
        server.close()
    _assert_no_thread_failed(thread_deaths, log)


def test_the_table_refuses_writes_past_its_limits_and_serves_on(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(store_module, "MAX_TABLE_BYTES", 1000)
    monkeypatch.setattr(store_module, "MAX_TABLE_KEYS", 3)
    port, secret = free_port(), new_secret()
    server = StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=2)
    store = connect_store(HOST, port, secret=secret, trainer_id=TRAINER, rank=1, timeout_s=10)
    try:
        store.set("a", b"x" * 600)
        with pytest.raises(dist.DistStoreError, match=f"{HOST}:{port} refused.*more than 1000"):
            store.set("b", b"x" * 600)
        store.set("a", b"x" * 900)  # replacing a value counts its new size only
        assert store.delete_key("a")
        store.set("b", b"x" * 600)
        store.set("c", b"1")
        store.set("d", b"1")
        with pytest.raises(dist.DistStoreError, match="holds 3 keys already"):
            store.set("e", b"1")
        assert store.num_keys() == 3 and not store.check(["e"])
        _wait_logged(log, "holds 3 keys already")
        # a request the server would refuse as malformed is refused before it is sent
        with pytest.raises(ValueError, match="a store key of 4097 bytes"):
            store.set("k" * 4097, b"1")
        with pytest.raises(ValueError, match="must fit in 64 bits"):
            store.add("n", 1 << 63)
        with pytest.raises(ValueError, match="set request of"):
            store.set("big", b"x" * (1 << 20))
        assert store.num_keys() == 3  # and the connection still serves
    finally:
        store.close()
        server.close()


def test_a_failure_inside_a_connection_thread_is_logged_and_closes_that_connection_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    """A bug no input should reach (here: the request handler raising on key 'boom')
    ends at the thread's top: logged at ERROR naming the peer, its connection closed."""
    serve = store_module._serve_request

    def buggy(table: Any, code: int, fields: list[bytes]) -> Any:
        if fields[:1] == [b"boom"]:
            raise RuntimeError("a bug in the store")
        return serve(table, code, fields)

    monkeypatch.setattr(store_module, "_serve_request", buggy)
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    port, secret = free_port(), new_secret()
    server = StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=3)
    hit = connect_store(HOST, port, secret=secret, trainer_id=TRAINER, rank=1, timeout_s=5)
    other = connect_store(HOST, port, secret=secret, trainer_id=TRAINER, rank=2, timeout_s=5)
    try:
        with pytest.raises(dist.DistStoreError, match=f"{HOST}:{port} stopped answering"):
            hit.set("boom", b"1")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "its connection failed" in errors[0].getMessage()
        assert errors[0].exc_info is not None and "a bug in the store" in str(errors[0].exc_info[1])
        other.set("fine", b"1")
        assert server.store.get("fine") == b"1" and server.connections == 1
    finally:
        hit.close()
        other.close()
        server.close()
    assert not thread_deaths


# ------------------------------------------------------------------ relays on the worker's path


def _relay(port: int, action: str, arg: str = "") -> tuple[Stray, int]:
    """A relay process listening on a fresh port, forwarding to the store at `port`."""
    listen = free_port()
    relay = Stray("relay", HOST, port, listen, action, *([arg] if arg else []))
    relay.line("listening")
    return relay, listen


def _join_via(listen: int, secret: str, rank: int = 1, timeout_s: float = 10) -> RemoteStore:
    return connect_store(
        HOST, listen, secret=secret, trainer_id=TRAINER, rank=rank, timeout_s=timeout_s
    )


def test_an_honest_relay_carries_a_group_that_forms_and_broadcasts_bit_exact(
    thread_deaths: list[str], log: pytest.LogCaptureFixture
) -> None:
    port, secret = free_port(), new_secret()
    joining = _host(port, secret)
    relay, listen = _relay(port, "pass")
    with relay:
        worker = Worker(listen, secret)  # pointed at the relay
        try:
            group = joining.result(WAIT_S)
            assert relay.line("accepted") == "0"
            assert worker.result("joined") == 1
            _broadcast_exact(group, worker)  # the worker polls trainer_alive through the relay
            assert group.server is not None and group.server.admitted == {1}
            group.close()
        finally:
            worker.stop()
    assert not _refusals(log)
    _assert_no_thread_failed(thread_deaths, log)


def test_a_relay_rewriting_a_workers_address_is_refused_and_the_store_never_holds_it(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    """The reported fault: the worker's gloo address, rewritten on the way by a relay."""
    servers: list[StoreServer] = []

    class Recorded(StoreServer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(group_module, "StoreServer", Recorded)
    port, secret = free_port(), new_secret()
    rewritten = "10.66.66.66:6666"
    joining: Future[StatelessGroup] = in_background(
        lambda: StatelessGroup.create(
            host=HOST,
            port=port,
            rank=0,
            world_size=2,
            secret=secret,
            trainer_id=TRAINER,
            timeout_s=5.0,
        ),
        name="test-rendezvous",
    )
    relay, listen = _relay(port, "rewrite-set", rewritten)
    with relay:
        worker = Worker(listen, secret)
        try:
            key = relay.line("rewrote")
            error = worker.result("error")
            assert f"{HOST}:{listen}" in error and "failed authentication" in error, error
            assert "failed its tag" in error, error
            with pytest.raises(Exception, match=r"did not appear|failed to join"):
                joining.result(WAIT_S)  # rank 0 never saw rank 1's address
        finally:
            worker.stop()
    message = _wait_logged(log, "failed authentication")
    assert "rank 1 sent a frame that failed authentication" in message
    held = servers[0].table.snapshot()
    assert key not in held and rewritten.encode() not in held.values(), held
    _assert_no_thread_failed(thread_deaths, log)


def _bare_server(secret: str) -> tuple[StoreServer, int]:
    port = free_port()
    return StoreServer(HOST, port, secret=secret, trainer_id=TRAINER, world_size=3), port


def test_a_relay_replaying_a_request_is_refused_and_the_store_keeps_the_later_value(
    log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    secret = new_secret()
    server, port = _bare_server(secret)
    relay, listen = _relay(port, "replay")
    try:
        with relay:
            store = _join_via(listen, secret)
            store.set("addr", b"127.0.0.1:1111")
            store.set("addr", b"127.0.0.1:2222")  # the relay sends the first set again after it
            relay.line("replayed")
            message = _wait_logged(log, "failed authentication")
            assert "frame number 0 came where 2 was due" in message and "rank 1" in message
            assert server.store.get("addr") == b"127.0.0.1:2222"
            with pytest.raises(dist.DistStoreError, match=rf"{HOST}:{listen}.*failed auth"):
                store.check(["addr"])  # the store's last word, then the connection is gone
            with pytest.raises(dist.DistStoreError, match="is closed"):
                store.check(["addr"])
    finally:
        server.close()
    _assert_no_thread_failed(thread_deaths, log)


def test_a_relay_reflecting_an_answer_back_as_a_request_is_refused(
    log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    """Answer 1 and request 1 carry the same number: only the direction in the tag differs."""
    secret = new_secret()
    server, port = _bare_server(secret)
    relay, listen = _relay(port, "reflect")
    try:
        with relay:
            store = _join_via(listen, secret)
            store.set("k", b"v")
            relay.line("reflected")
            message = _wait_logged(log, "failed authentication")
            assert "frame 1 failed its tag" in message and "rank 1" in message
            with pytest.raises(dist.DistStoreError, match=rf"{HOST}:{listen}"):
                store.check(["k"])
            assert server.store.num_keys() == 1
    finally:
        server.close()
    _assert_no_thread_failed(thread_deaths, log)


def test_a_request_spliced_in_from_another_connection_is_refused(
    log: pytest.LogCaptureFixture, thread_deaths: list[str]
) -> None:
    """The relay gives rank 2's connection rank 1's first request (same number, other key)."""
    secret = new_secret()
    server, port = _bare_server(secret)
    relay, listen = _relay(port, "splice")
    try:
        with relay:
            first = _join_via(listen, secret, rank=1)
            first.set("who", b"rank 1")
            second = _join_via(listen, secret, rank=2)
            with pytest.raises(dist.DistStoreError, match=rf"{HOST}:{listen}.*failed auth"):
                second.set("who", b"rank 2")
            relay.line("spliced")
            message = _wait_logged(log, "rank 2 sent a frame that failed authentication")
            assert "frame 0 failed its tag" in message
            assert server.store.get("who") == b"rank 1"  # applied once, by its own connection
            first.set("still", b"served")
            assert server.store.get("still") == b"served"
            first.close()
    finally:
        server.close()
    _assert_no_thread_failed(thread_deaths, log)


@pytest.mark.parametrize(
    ("action", "what"),
    [
        ("rewrite-answer", "failed its tag"),
        ("replay-answer", "frame number 1 came where 2 was due"),
    ],
)
def test_a_worker_refuses_a_meddled_answer_naming_the_store_and_logs_it(
    action: str, what: str, log: pytest.LogCaptureFixture
) -> None:
    secret = new_secret()
    server, port = _bare_server(secret)
    server.store.set("addr", b"127.0.0.1:1234")
    relay, listen = _relay(port, action)
    try:
        with relay:
            store = _join_via(listen, secret)
            pattern = rf"store at {HOST}:{listen} sent an answer that failed authentication"
            with pytest.raises(dist.DistStoreError, match=pattern) as refused:
                assert store.get("addr") == b"127.0.0.1:1234"  # answer 1, as sent
                store.get("addr")  # answer 2
            assert what in str(refused.value)
            message = _wait_logged(log, f"rank 1 dropped the trainer's store at {HOST}:{listen}")
            assert what in message
            with pytest.raises(dist.DistStoreError, match="is closed"):
                store.check(["addr"])
    finally:
        server.close()


def test_a_relay_dropping_a_request_fails_the_call_bounded_and_applies_nothing() -> None:
    secret = new_secret()
    server, port = _bare_server(secret)
    relay, listen = _relay(port, "drop")
    try:
        with relay:
            store = _join_via(listen, secret, timeout_s=1.0)
            t0 = time.monotonic()
            with pytest.raises(dist.DistStoreError, match=rf"{HOST}:{listen} stopped answering"):
                store.set("addr", b"127.0.0.1:1234")
            assert time.monotonic() - t0 < 5.0
            relay.line("dropped")
            assert server.store.num_keys() == 0
    finally:
        server.close()


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    """`free_port` never names a port the kernel may hand to an outgoing connection
    (a group's port taken that way failed a rendezvous with "address already in use")."""
    import socket
    from pathlib import Path

    from wt_kits.group.stateless import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(10000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # chosen at random, not one port again and again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
