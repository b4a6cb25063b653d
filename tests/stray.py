"""A stray process on a group's store port: stdlib only, run as its own OS process.

    python tests/stray.py silent HOST PORT SECONDS  connect, say nothing for SECONDS
    python tests/stray.py claim HOST PORT RANK      claim RANK, with a proof made without the secret
    python tests/stray.py server HOST PORT          listen there, play trainer without the secret
    python tests/stray.py admitted HOST PORT RANK CASE  join as RANK with the secret, then
                                                    misbehave as CASE says (`CASES`)
    python tests/stray.py relay HOST PORT LISTEN ACTION [ARG]  forward connections made to
                                                    LISTEN to PORT, meddling as ACTION says

It reports on stdout, one line per event: `connected ADDR` (its own address),
`verdict STATUS REASON` and `after CLOSED|OPEN` (claim: whether the trainer
still serves the connection after refusing it), `listening`, then `proof` or
`no-proof` (server: whether the worker sent its proof after a challenge it
could not check). `admitted` (secret and trainer id in the environment, as
`Stray(..., secret=, trainer_id=)` passes them) says `admitted`, `sent CASE`,
then `answer STATUS REASON` per answer whose tag checks (`answer-forged` for
one that does not), and `closed` when the store closes the connection (`open`
if it still holds it 5 s after the last answer). `relay` says `listening`, `accepted N` per
connection and one line per meddling (`rewrote KEY`, `replayed`, ...).
`Stray` starts one and reads its lines with a deadline.

`admitted` and `relay` speak the store's session frames as `kits/group/auth.py`
and `kits/group/store.py` document them, written here again from that text (so
these tests also hold the code to its documented wire format).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import queue
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

WAIT_S = 20.0  # the longest any stray waits for anything


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("closed")
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">I", _read(sock, 4))
    return _read(sock, min(size, 1 << 16))


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                sys.exit(2)
            time.sleep(0.02)
    sock.settimeout(WAIT_S)
    local_host, local_port = sock.getsockname()[:2]
    print("connected", f"{local_host}:{local_port}", flush=True)
    return sock


def _claim(host: str, port: int, rank: int) -> None:
    sock = _connect(host, port)
    sock.sendall(_frame(b"wtstore1" + struct.pack(">I", rank) + os.urandom(32)))
    challenge = _read_frame(sock)
    guess = hmac.new(os.urandom(32), challenge, hashlib.sha256).digest()
    sock.sendall(_frame(guess))
    verdict = _read_frame(sock)
    print("verdict", verdict[:1].hex(), verdict[1:].decode(errors="replace"), flush=True)
    try:  # a store request as if admitted: set a key
        sock.sendall(_frame(bytes([1]) + _frame(b"wt/0/0") + _frame(b"forged")))
        print("after", "OPEN" if sock.recv(1) else "CLOSED", flush=True)
    except OSError:
        print("after", "CLOSED", flush=True)


def _server(host: str, port: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(8)
    listener.settimeout(WAIT_S)
    print("listening", flush=True)
    conn, _ = listener.accept()
    conn.settimeout(5.0)
    _read_frame(conn)  # the worker's hello
    conn.sendall(_frame(os.urandom(64)))  # a nonce and a "proof" made without the secret
    try:
        _read_frame(conn)
        print("proof", flush=True)
    except (EOFError, OSError):
        print("no-proof", flush=True)


def _flood(host: str, port: int, count: int, seconds: float) -> None:
    """Hold `count` silent connections; each one the server drops is replaced at once."""
    socks = [_connect(host, port) for _ in range(count)]
    print("flooding", count, flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        readable, _, _ = select.select(socks, [], [], 0.05)
        for sock in readable:  # dropped (or told BUSY): replace it
            socks.remove(sock)
            sock.close()
            socks.append(_connect(host, port))
    for sock in socks:
        sock.close()
    print("flood over", flush=True)


# ------------------------------------------------------------------ the store's wire, as documented

TO_TRAINER, TO_WORKER = b"\x01", b"\x02"
SEQ_BYTES, TAG_BYTES = 8, 16
SET, GET, ADD, CHECK, WAIT, DELETE, COMPARE_SET, NUM_KEYS = range(1, 9)


def _body(op: int, *fields: bytes) -> bytes:
    return bytes([op]) + b"".join(_frame(f) for f in fields)


def _fields(body: bytes) -> list[bytes]:
    """The fields after a body's first byte (a well-formed body)."""
    fields, at = [], 1
    while at < len(body):
        (size,) = struct.unpack_from(">I", body, at)
        fields.append(body[at + 4 : at + 4 + size])
        at += 4 + size
    return fields


class _Session:
    """One side of a store session: builds and checks its tagged, numbered frames."""

    def __init__(self, key: bytes, sends: bytes, receives: bytes) -> None:
        self.key, self.sends, self.receives = key, sends, receives
        self.sent = self.received = 0

    def _tag(self, direction: bytes, seq: int, body: bytes) -> bytes:
        message = direction + struct.pack(">Q", seq) + body
        return hmac.new(self.key, message, hashlib.sha256).digest()[:TAG_BYTES]

    def frame(self, body: bytes, seq: int | None = None, tag: bytes | None = None) -> bytes:
        """The next frame for `body` (or one numbered `seq`, or with a given `tag`)."""
        if seq is None:
            seq, self.sent = self.sent, self.sent + 1
        tag = self._tag(self.sends, seq, body) if tag is None else tag
        return _frame(struct.pack(">Q", seq) + body + tag)

    def read(self, sock: socket.socket) -> bytes | None:
        """The peer's next body, or None if its tag or number does not check."""
        return self.check(_read_frame(sock))

    def check(self, frame: bytes) -> bytes | None:
        """The body of `frame` (read already) if it is the peer's next frame, else None."""
        seq, body, tag = frame[:SEQ_BYTES], frame[SEQ_BYTES:-TAG_BYTES], frame[-TAG_BYTES:]
        (number,) = struct.unpack(">Q", seq)
        ok = hmac.compare_digest(tag, self._tag(self.receives, number, body))
        if not ok or number != self.received:
            return None
        self.received += 1
        return body


def _proof(secret: str, role: bytes, trainer: str, rank: int, wn: bytes, tn: bytes) -> bytes:
    label = b"\0".join((b"wt-store", role, trainer.encode(), str(rank).encode()))
    return hmac.new(secret.encode(), label + wn + tn, hashlib.sha256).digest()


def _join(host: str, port: int, rank: int) -> tuple[socket.socket, _Session, bytes]:
    """Join as `rank` with the secret; the socket, the session and the verdict frame."""
    secret, trainer = os.environ["WT_STRAY_SECRET"], os.environ["WT_STRAY_TRAINER"]
    sock = _connect(host, port)
    worker_nonce = os.urandom(32)
    sock.sendall(_frame(b"wtstore1" + struct.pack(">I", rank) + worker_nonce))
    challenge = _read_frame(sock)
    trainer_nonce = challenge[:32]
    sock.sendall(_frame(_proof(secret, b"worker", trainer, rank, worker_nonce, trainer_nonce)))
    key = _proof(secret, b"session", trainer, rank, worker_nonce, trainer_nonce)
    session = _Session(key, TO_TRAINER, TO_WORKER)
    verdict_frame = _read_frame(sock)
    verdict = session.check(verdict_frame)
    if verdict != b"\x00":
        sys.exit(f"not admitted: {verdict!r}")
    return sock, session, _frame(verdict_frame)


_DIGITS_4000 = b"1" + b"0" * 4000  # 10**4000: more than any float holds


def _case(name: str, s: _Session, verdict: bytes) -> list[bytes]:
    """What `admitted` case `name` sends after the handshake: frames, or raw bytes."""
    num_keys = _body(NUM_KEYS)
    first = s.frame(num_keys, seq=0)
    cases: dict[str, Callable[[], list[bytes]]] = {
        "wait-overflow": lambda: [s.frame(_body(WAIT, _DIGITS_4000, b"k"))],
        "get-overflow": lambda: [s.frame(_body(GET, b"k", _DIGITS_4000))],
        "wait-negative": lambda: [s.frame(_body(WAIT, b"-1", b"k"))],
        "wait-too-long": lambda: [s.frame(_body(WAIT, b"3600000", b"k"))],
        "wait-not-decimal": lambda: [s.frame(_body(WAIT, b" 1_0", b"k"))],
        "wait-no-fields": lambda: [s.frame(_body(WAIT))],
        "add-past-64-bits": lambda: [s.frame(_body(ADD, b"n", b"9223372036854775808"))],
        "add-overflow": lambda: [s.frame(_body(ADD, b"n", b"-" + _DIGITS_4000))],
        "op-unknown": lambda: [s.frame(_body(99))],
        "op-zero": lambda: [s.frame(_body(0, b"k"))],
        "body-empty": lambda: [s.frame(b"")],
        "set-three-fields": lambda: [s.frame(_body(SET, b"k", b"v", b"extra"))],
        "num-keys-one-field": lambda: [s.frame(_body(NUM_KEYS, b"k"))],
        "check-too-many-fields": lambda: [s.frame(_body(CHECK, *[b"k"] * 4097))],
        "field-length-negative": lambda: [s.frame(bytes([SET]) + b"\xff\xff\xff\xff" + b"k")],
        "field-length-cut": lambda: [s.frame(bytes([SET]) + b"\x00\x00")],
        "key-not-utf8": lambda: [s.frame(_body(SET, b"\xff\xfe", b"v"))],
        "key-too-long": lambda: [s.frame(_body(SET, b"k" * 4097, b"v"))],
        "frame-length-negative": lambda: [b"\xff\xff\xff\xff"],
        "frame-length-huge": lambda: [struct.pack(">I", (1 << 20) + SEQ_BYTES + TAG_BYTES + 1)],
        "frame-cut": lambda: [struct.pack(">I", 100) + b"x" * 10],
        "frame-short": lambda: [_frame(b"x" * 5)],
        "tag-forged": lambda: [s.frame(num_keys, tag=b"\0" * TAG_BYTES)],
        "seq-skipped": lambda: [s.frame(num_keys, seq=1)],
        "seq-replayed": lambda: [first, first],
        "seq-reordered": lambda: [s.frame(num_keys, seq=1) + first],
        "reflected": lambda: [verdict],
        "add-wraps": lambda: [
            s.frame(_body(SET, b"n", b"9223372036854775807")),
            s.frame(_body(ADD, b"n", b"1")),
            s.frame(num_keys),
        ],
    }
    return cases[name]()


def _admitted(host: str, port: int, rank: int, case: str) -> None:
    """Join as `rank` with the secret, send what `case` says, report every answer."""
    sock, session, verdict = _join(host, port, rank)
    print("admitted", flush=True)
    for data in _case(case, session, verdict):
        sock.sendall(data)
    if case == "frame-cut":
        sock.shutdown(socket.SHUT_WR)  # the rest of the frame never comes
    print("sent", case, flush=True)
    sock.settimeout(5.0)  # a store that keeps the connection answers at once
    while True:
        try:
            body = session.read(sock)
        except TimeoutError:
            print("open", flush=True)
            return
        except (EOFError, OSError):
            print("closed", flush=True)
            return
        if body is None:
            print("answer-forged", flush=True)
            continue
        reason = b"".join(_fields(body)).decode(errors="replace")
        print("answer", body[:1].hex(), reason, flush=True)


class _Relay:
    """Forwards each connection to the trainer frame by frame, meddling as `action` says.

    Frames 0 and 1 each way are the handshake; after them, in the worker's
    direction, `rewrite-set` puts ARG in place of the first set's value,
    `replay` sends request 0 again after request 1, `drop` swallows request 0,
    `splice` gives connection 1 connection 0's request 0 in place of its own;
    in the trainer's, `rewrite-answer` flips a byte of the first answer with a
    value, `replay-answer` gives answer 0 in place of answer 1, `reflect` also
    sends answer 0 back to the trainer. `pass` only forwards.
    """

    def __init__(self, target: tuple[str, int], action: str, arg: bytes) -> None:
        self.target, self.action, self.arg = target, action, arg
        self.first_requests: dict[int, bytes] = {}  # by connection
        self.first_answers: dict[int, bytes] = {}
        self.done = False  # every action meddles once

    def serve(self, listener: socket.socket) -> None:
        index = 0
        while True:
            conn, _ = listener.accept()
            upstream = socket.create_connection(self.target, timeout=WAIT_S)
            print("accepted", index, flush=True)
            links = {TO_TRAINER: _Link(upstream), TO_WORKER: _Link(conn)}
            for src, direction in ((conn, TO_TRAINER), (upstream, TO_WORKER)):
                threading.Thread(
                    target=self._pump, args=(src, direction, links, index), daemon=True
                ).start()
            index += 1

    def _pump(
        self, src: socket.socket, direction: bytes, links: dict[bytes, _Link], conn: int
    ) -> None:
        src.settimeout(None)
        count = 0
        try:
            while True:
                frame = _read_frame_whole(src)
                for to, data in self._meddle(direction, conn, count - 2, frame):
                    links[to].send(data)
                count += 1
        except (EOFError, OSError):
            for link in links.values():
                link.close()

    def _meddle(
        self, direction: bytes, conn: int, index: int, frame: bytes
    ) -> list[tuple[bytes, bytes]]:
        """What to send for post-handshake frame `index` (< 0: the handshake) of `conn`."""
        seq, body, tag = frame[:SEQ_BYTES], frame[SEQ_BYTES:-TAG_BYTES], frame[-TAG_BYTES:]
        out = [(direction, frame)]
        action = None if self.done or index < 0 else self.action
        if direction == TO_TRAINER:
            if index == 0:
                self.first_requests[conn] = frame
            if action == "rewrite-set" and body[:1] == bytes([SET]):
                key = _fields(body)[0]
                out = [(direction, seq + _body(SET, key, self.arg) + tag)]
                self._note("rewrote", key.decode(errors="replace"))
            elif action == "replay" and index == 1:
                out.append((direction, self.first_requests[conn]))
                self._note("replayed")
            elif action == "drop" and index == 0:
                out = []
                self._note("dropped")
            elif action == "splice" and conn == 1 and index == 0:
                out = [(direction, self.first_requests[0])]
                self._note("spliced")
        else:
            if index == 0:
                self.first_answers[conn] = frame
            if action == "rewrite-answer" and body[:1] == b"\x00" and len(body) > 5:
                out = [(direction, seq + body[:-1] + bytes([body[-1] ^ 1]) + tag)]
                self._note("rewrote answer")
            elif action == "replay-answer" and index == 1:
                out = [(direction, self.first_answers[conn])]
                self._note("replayed answer")
            elif action == "reflect" and index == 0:
                out.append((TO_TRAINER, frame))
                self._note("reflected")
        return [(to, _frame(data)) for to, data in out]

    def _note(self, *words: str) -> None:
        self.done = True
        print(*words, flush=True)


class _Link:
    """One side of a relayed connection; sends from both pumps do not interleave."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def close(self) -> None:
        with self.lock:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def _read_frame_whole(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">I", _read(sock, 4))
    return _read(sock, size)


def _relay(host: str, port: int, listen: int, action: str, arg: bytes) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, listen))
    listener.listen(8)
    print("listening", flush=True)
    _Relay((host, port), action, arg).serve(listener)


def main(argv: list[str]) -> None:
    mode, host, port = argv[0], argv[1], int(argv[2])
    if mode == "silent":
        sock = _connect(host, port)
        time.sleep(float(argv[3]))
        sock.close()
    elif mode == "flood":  # keep `count` silent connections open for `seconds`
        _flood(host, port, int(argv[3]), float(argv[4]))
    elif mode == "claim":
        _claim(host, port, int(argv[3]))
    elif mode == "server":
        _server(host, port)
    elif mode == "admitted":
        _admitted(host, port, int(argv[3]), argv[4])
    elif mode == "relay":
        _relay(host, port, int(argv[3]), argv[4], (argv[5] if len(argv) > 5 else "").encode())
    else:
        sys.exit(f"unknown mode {mode!r}")


class Stray:
    """One stray process (see the module doc); `line(prefix)` waits for its next such line."""

    def __init__(
        self,
        mode: str,
        host: str,
        port: int,
        *extra: object,
        secret: str | None = None,
        trainer_id: str | None = None,
    ) -> None:
        args = [sys.executable, os.path.abspath(__file__), mode, host, str(port), *map(str, extra)]
        env = dict(os.environ)
        if secret is not None and trainer_id is not None:  # for `admitted`, off the command line
            env.update(WT_STRAY_SECRET=secret, WT_STRAY_TRAINER=trainer_id)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def line(self, prefix: str, timeout_s: float = WAIT_S) -> str:
        """The rest of its next line starting with `prefix`; `AssertionError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the stray said no {prefix!r} within {timeout_s:g}s"
                ) from None
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def until(self, prefix: str, timeout_s: float = WAIT_S) -> list[str]:
        """Every line before its next one starting with `prefix` (which is consumed)."""
        deadline = time.monotonic() + timeout_s
        before: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the stray said no {prefix!r} within {timeout_s:g}s (only {before})"
                ) from None
            if line.startswith(prefix):
                return before
            before.append(line)

    def stop(self) -> None:
        """End it (by its own pid) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Stray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
