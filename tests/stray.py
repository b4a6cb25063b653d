"""A stray process on a group's store port: stdlib only, run as its own OS process.

    python tests/stray.py silent HOST PORT SECONDS  connect, say nothing for SECONDS
    python tests/stray.py claim HOST PORT RANK      claim RANK, with a proof made without the secret
    python tests/stray.py server HOST PORT          listen there, play trainer without the secret

It reports on stdout, one line per event: `connected ADDR` (its own address),
`verdict STATUS REASON` and `after CLOSED|OPEN` (claim: whether the trainer
still serves the connection after refusing it), `listening`, then `proof` or
`no-proof` (server: whether the worker sent its proof after a challenge it
could not check). `Stray` starts one and reads its lines with a deadline.
"""

from __future__ import annotations

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
    else:
        sys.exit(f"unknown mode {mode!r}")


class Stray:
    """One stray process (see the module doc); `line(prefix)` waits for its next such line."""

    def __init__(self, mode: str, host: str, port: int, *extra: object) -> None:
        args = [sys.executable, os.path.abspath(__file__), mode, host, str(port), *map(str, extra)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
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
