"""The private group's rendezvous store: admits only workers that prove the secret.

`StoreServer` (trainer rank 0) listens on exactly the address it is given and
serves an in-memory key table; `server.store` is rank 0's own view of it.
`connect_store(...)` (a worker) connects, runs the mutual handshake of
`transport/auth.py` and returns a `RemoteStore`. Both stores are
`torch.distributed.Store`s, so gloo and NCCL build their groups over them.

Admission: a connection is served only after it proved the secret for a rank
in `[1, world_size)` that no connection has been admitted for yet (a second
admission of a rank is refused, even after the first left). Each connection
has its own daemon thread and its handshake a deadline, so a silent, slow or
hostile peer holds only its own thread until that deadline and cannot stall
anyone else; at most `MAX_PENDING_HANDSHAKES` are in progress at once. Every
refusal is logged at WARNING on the `weight_transfer` logger, naming the peer
and the reason; a worker that refuses a server logs it too and raises
`StoreRefused` naming the address.

After the handshake a request is one frame: an op byte and length-prefixed
fields; the answer a status byte and fields. Requests that wait (get, wait)
wait at most `WAIT_SLICE_S` at the server; the client repeats them until its
own timeout, so no request holds a connection long and every wait is bounded.
`close()` closes the listening socket at once (it is bound with
`SO_REUSEADDR`, so the next rendezvous can bind the same port) and every
connection, which the workers see as the trainer gone.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from weight_transfer.transport.auth import (
    BUSY,
    FrameError,
    HandshakeError,
    PeerClosed,
    TrainerBusy,
    check_secret,
    client_handshake,
    recv_frame,
    send_frame,
    send_verdict,
    server_handshake,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_PENDING_HANDSHAKES",
    "WAIT_SLICE_S",
    "StoreRefused",
    "StoreServer",
    "LocalStore",
    "RemoteStore",
    "connect_store",
]

logger = logging.getLogger("weight_transfer")

# Longest a connection may take to complete its handshake (never more than the caller's timeout).
HANDSHAKE_TIMEOUT_S = 10.0
# Handshakes in progress at once; a connection beyond that is told BUSY and closed
# (a worker told BUSY tries again until its deadline).
MAX_PENDING_HANDSHAKES = 256
# Longest one request waits at the server; a client repeats it until its own deadline.
WAIT_SLICE_S = 0.5
# Largest request or answer (gloo and NCCL exchange addresses and ids of a few hundred bytes).
MAX_FRAME_BYTES = 1 << 20
_MAX_FIELDS = 4096
# Time an answer may take beyond the wait it asked for, at most.
_IO_GRACE_S = 10.0

_SET, _GET, _ADD, _CHECK, _WAIT, _DELETE, _COMPARE_SET, _NUM_KEYS = range(1, 9)
_OK, _TIMEOUT, _ERROR = range(3)
_LEN = struct.Struct(">I")
T = TypeVar("T")


class StoreRefused(RuntimeError):
    """A worker would not join through this store, or the trainer would not admit it."""


class StoreClosed(RuntimeError):
    """The table was closed (its group is gone)."""


def _encode(code: int, fields: Sequence[bytes]) -> bytes:
    return bytes([code]) + b"".join(_LEN.pack(len(f)) + f for f in fields)


def _decode(body: bytes) -> tuple[int, list[bytes]]:
    """`(code, fields)` of a request or answer; `FrameError` if it is not one."""
    if not body:
        raise FrameError("an empty frame")
    fields: list[bytes] = []
    at = 1
    while at < len(body):
        if len(fields) == _MAX_FIELDS or at + _LEN.size > len(body):
            raise FrameError("a frame with a cut or excess field")
        (size,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + size > len(body):
            raise FrameError(f"a field of {size} bytes past the end of its frame")
        fields.append(body[at : at + size])
        at += size
    return body[0], fields


def _text(field: bytes) -> str:
    try:
        return field.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("a key that is not UTF-8") from None


def _number(field: bytes) -> int:
    try:
        return int(field.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("a number field that is not a decimal integer") from None


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class KeyTable:
    """The store's keys; thread-safe. Waits are bounded by the caller's `wait_s`.

    After `close()` every operation (and every wait in progress) raises `StoreClosed`.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise StoreClosed("the trainer's store is closed (its group is gone)")

    def _wait_for(self, ready: Callable[[], bool], wait_s: float) -> bool:
        ok = self._cond.wait_for(lambda: self._closed or ready(), max(0.0, wait_s))
        self._open()
        return ok

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._open()
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, wait_s: float) -> bytes | None:
        """The value of `key`, waiting up to `wait_s` for it; None if it is still missing."""
        with self._cond:
            self._open()
            if not self._wait_for(lambda: key in self._data, wait_s):
                return None
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the decimal integer at `key` (0 if missing); the new value."""
        with self._cond:
            self._open()
            try:
                value = int(self._data.get(key, b"0")) + amount
            except ValueError:
                raise ValueError(f"key {key!r} does not hold an integer") from None
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            self._open()
            return all(k in self._data for k in keys)

    def wait(self, keys: Sequence[str], wait_s: float) -> bool:
        """Whether every key of `keys` was there within `wait_s`."""
        with self._cond:
            self._open()
            return self._wait_for(lambda: all(k in self._data for k in keys), wait_s)

    def delete(self, key: str) -> bool:
        with self._cond:
            self._open()
            return self._data.pop(key, None) is not None

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """`TCPStore`'s rule: set `desired` if `key` holds `expected` (or is missing and
        `expected` is empty); returns the value the key holds afterwards (for a missing
        key and a non-empty `expected`: `expected`)."""
        with self._cond:
            self._open()
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                self._cond.notify_all()
                return desired
            return expected if current is None else current

    def num_keys(self) -> int:
        with self._cond:
            self._open()
            return len(self._data)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _BoundedStore(dist.Store):
    """A `dist.Store` whose blocking calls repeat a bounded primitive until the timeout.

    Subclasses give `_get_once(key, wait_s)` (value or None) and
    `_wait_once(keys, wait_s)` (all there?); `get` waits up to the store's
    `timeout`, `wait` up to its argument or that. A timeout raises
    `DistStoreError` naming the keys.
    """

    timeout: timedelta  # torch's own property (`set_timeout`), declared for the type checker

    def _get_once(self, key: str, wait_s: float) -> bytes | None:
        raise NotImplementedError

    def _wait_once(self, keys: Sequence[str], wait_s: float) -> bool:
        raise NotImplementedError

    def _until(self, attempt: Callable[[float], T | None], timeout_s: float, what: str) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            result = attempt(min(WAIT_SLICE_S, max(0.0, remaining)))
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"{what} did not appear within {timeout_s:g}s")

    def get(self, key: str) -> bytes:
        timeout_s = self.timeout.total_seconds()
        return self._until(lambda s: self._get_once(key, s), timeout_s, f"store key {key!r}")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = (timeout or self.timeout).total_seconds()
        self._until(
            lambda s: True if self._wait_once(keys, s) else None,
            timeout_s,
            f"store keys {keys!r}",
        )

    def clone(self) -> _BoundedStore:
        """This store: it is safe to share between threads."""
        return self


class LocalStore(_BoundedStore):
    """Rank 0's view of its own `StoreServer`'s table (no socket)."""

    def __init__(self, table: KeyTable) -> None:
        super().__init__()
        self._table = table

    def _get_once(self, key: str, wait_s: float) -> bytes | None:
        return self._table.get(key, wait_s)

    def _wait_once(self, keys: Sequence[str], wait_s: float) -> bool:
        return self._table.wait(keys, wait_s)

    def set(self, key: str, value: str | bytes) -> None:
        self._table.set(key, _as_bytes(value))

    def add(self, key: str, amount: int) -> int:
        return self._table.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._table.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._table.delete(key)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._table.compare_set(key, _as_bytes(expected), _as_bytes(desired))

    def num_keys(self) -> int:
        return self._table.num_keys()


class RemoteStore(_BoundedStore):
    """A worker's admitted connection to the trainer's store; thread-safe (one request at a time).

    A connection that fails or breaks the framing is dropped, and every later
    call raises `DistStoreError` naming the address (the trainer is gone).
    """

    def __init__(self, sock: socket.socket, address: str, timeout_s: float) -> None:
        super().__init__()
        self._sock: socket.socket | None = sock
        self.address = address
        self._lock = threading.Lock()
        self._io_s = min(timeout_s, _IO_GRACE_S)

    def _call(
        self, code: int, fields: Sequence[bytes], wait_s: float = 0.0
    ) -> tuple[int, list[bytes]]:
        with self._lock:
            sock = self._sock
            if sock is None:
                raise dist.DistStoreError(
                    f"the connection to the trainer's store at {self.address} is closed"
                )
            deadline = time.monotonic() + wait_s + self._io_s
            try:
                send_frame(sock, _encode(code, fields), deadline)
                status, answer = _decode(recv_frame(sock, deadline, MAX_FRAME_BYTES))
            except OSError as e:  # timeouts and framing errors included
                self._drop()
                raise dist.DistStoreError(
                    f"the trainer's store at {self.address} stopped answering: {e}"
                ) from None
        if status == _ERROR:
            reason = answer[0].decode("utf-8", "replace") if answer else "no reason"
            raise dist.DistStoreError(f"the trainer's store at {self.address} refused: {reason}")
        return status, answer

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        """Leave the store; later calls raise. Idempotent."""
        with self._lock:
            self._drop()

    def _get_once(self, key: str, wait_s: float) -> bytes | None:
        wait_ms = str(int(wait_s * 1000)).encode()
        status, answer = self._call(_GET, [key.encode(), wait_ms], wait_s)
        return answer[0] if status == _OK and answer else None

    def _wait_once(self, keys: Sequence[str], wait_s: float) -> bool:
        wait_ms = str(int(wait_s * 1000)).encode()
        status, _ = self._call(_WAIT, [wait_ms, *(k.encode() for k in keys)], wait_s)
        return status == _OK

    def set(self, key: str, value: str | bytes) -> None:
        self._call(_SET, [key.encode(), _as_bytes(value)])

    def add(self, key: str, amount: int) -> int:
        _, answer = self._call(_ADD, [key.encode(), str(int(amount)).encode()])
        return int(answer[0])

    def check(self, keys: list[str]) -> bool:
        _, answer = self._call(_CHECK, [k.encode() for k in keys])
        return answer == [b"1"]

    def delete_key(self, key: str) -> bool:
        _, answer = self._call(_DELETE, [key.encode()])
        return answer == [b"1"]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        fields = [key.encode(), _as_bytes(expected), _as_bytes(desired)]
        _, answer = self._call(_COMPARE_SET, fields)
        return answer[0]

    def num_keys(self) -> int:
        _, answer = self._call(_NUM_KEYS, [])
        return int(answer[0])


def _serve_request(table: KeyTable, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
    """One request against `table`; `FrameError` if it is malformed."""
    n = len(fields)
    if code == _SET and n == 2:
        table.set(_text(fields[0]), fields[1])
        return _OK, []
    if code == _GET and n == 2:
        value = table.get(_text(fields[0]), min(_number(fields[1]) / 1000, WAIT_SLICE_S))
        return (_TIMEOUT, []) if value is None else (_OK, [value])
    if code == _ADD and n == 2:
        try:
            return _OK, [str(table.add(_text(fields[0]), _number(fields[1]))).encode()]
        except ValueError as e:
            return _ERROR, [str(e).encode()]
    if code == _CHECK:
        return _OK, [b"1" if table.check([_text(f) for f in fields]) else b"0"]
    if code == _WAIT and n >= 1:
        wait_s = min(_number(fields[0]) / 1000, WAIT_SLICE_S)
        return (_OK, []) if table.wait([_text(f) for f in fields[1:]], wait_s) else (_TIMEOUT, [])
    if code == _DELETE and n == 1:
        return _OK, [b"1" if table.delete(_text(fields[0])) else b"0"]
    if code == _COMPARE_SET and n == 3:
        return _OK, [table.compare_set(_text(fields[0]), fields[1], fields[2])]
    if code == _NUM_KEYS and n == 0:
        return _OK, [str(table.num_keys()).encode()]
    raise FrameError(f"an unknown request (op {code} with {n} fields)")


def _peer_name(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class StoreServer:
    """Rank 0's store server for a group of `world_size` (see module doc).

    Binds exactly `host:port` (`host` resolved once; never the wildcard unless
    the caller gave it). Raises `OSError` when the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: str,
        trainer_id: str,
        world_size: int,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._secret = check_secret(secret, what="StoreServer")
        self._trainer_id = trainer_id
        self._world_size = world_size
        self._handshake_s = handshake_timeout_s
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.address: tuple[str, int] = tuple(listener.getsockname()[:2])
        self._name = _peer_name(self.address)
        self.table = KeyTable()
        self.store = LocalStore(self.table)
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0
        self._admitted: set[int] = set()
        self._connections: set[socket.socket] = set()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"wt-store-{self.address[1]}", daemon=True
        )
        self._acceptor.start()

    @property
    def admitted(self) -> frozenset[int]:
        """The ranks admitted so far."""
        with self._lock:
            return frozenset(self._admitted)

    def _refused(self, peer: str, reason: str) -> None:
        logger.warning("wt store %s refused %s: %s", self._name, peer, reason)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # e.g. out of descriptors: try again
                continue
            name = _peer_name(peer)
            with self._lock:
                busy = self._pending >= MAX_PENDING_HANDSHAKES
                if not (self._closed or busy):
                    self._pending += 1
                    self._connections.add(conn)
            if self._closed or busy:
                if busy:
                    with contextlib.suppress(OSError):
                        send_frame(conn, BUSY, time.monotonic() + 0.5)
                    self._refused(name, "too many handshakes in progress (told it to retry)")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, name), name=f"wt-store-conn-{name}", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            rank = self._admit(conn, peer)
            if rank is not None:
                self._requests(conn, peer, rank)
        except OSError:
            pass  # the connection broke, or close() shut it
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket, peer: str) -> int | None:
        """The rank `conn` proved and was admitted for, or None (refused, logged)."""
        deadline = time.monotonic() + self._handshake_s
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rank = server_handshake(
                conn, secret=self._secret, trainer_id=self._trainer_id, deadline=deadline
            )
        except HandshakeError as e:
            if not self._closed:
                self._refused(peer, str(e))
            return None
        finally:
            with self._lock:
                self._pending -= 1
        with self._lock:
            if not 0 < rank < self._world_size:
                refusal: str | None = f"rank {rank} is outside [1, {self._world_size})"
            elif rank in self._admitted:
                refusal = f"rank {rank} has already joined (a second admission is refused)"
            else:
                refusal = None
                self._admitted.add(rank)
        send_verdict(conn, deadline, refusal)
        if refusal is not None:
            self._refused(peer, refusal)
            return None
        logger.debug("wt store %s admitted rank %d from %s", self._name, rank, peer)
        return rank

    def _requests(self, conn: socket.socket, peer: str, rank: int) -> None:
        while True:
            try:
                code, fields = _decode(recv_frame(conn, None, MAX_FRAME_BYTES))
                status, answer = _serve_request(self.table, code, fields)
            except PeerClosed:
                return
            except FrameError as e:
                if not self._closed:
                    self._refused(peer, f"rank {rank} sent a malformed frame ({e}); dropped")
                return
            except StoreClosed:
                return
            send_frame(conn, _encode(status, answer), time.monotonic() + _IO_GRACE_S)

    def close(self) -> None:
        """Stop listening at once, drop every connection and close the table. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self._acceptor.join(1.0)
        self._listener.close()
        self.table.close()
        for conn in connections:  # each connection's thread closes its own socket
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _connect(host: str, port: int, rank: int, deadline: float, timeout_s: float) -> socket.socket:
    """A connection to `host:port`, retrying a refused one until `deadline`."""
    address = f"{host}:{port}"
    while True:
        remaining = deadline - time.monotonic()
        try:
            return socket.create_connection((host, port), timeout=max(0.05, remaining))
        except ConnectionRefusedError:
            if remaining <= 0.1:
                raise RuntimeError(
                    f"rank {rank} could not reach the trainer's store at {address} within "
                    f"{timeout_s:g}s (nothing listens there)"
                ) from None
            time.sleep(0.1)
        except TimeoutError:
            raise RuntimeError(
                f"rank {rank} could not reach the trainer's store at {address} within "
                f"{timeout_s:g}s (nothing answered)"
            ) from None
        except OSError as e:
            raise RuntimeError(
                f"rank {rank} could not reach the trainer's store at {address}: {e}"
            ) from e


def connect_store(
    host: str,
    port: int,
    *,
    secret: str,
    trainer_id: str,
    rank: int,
    timeout_s: float,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> RemoteStore:
    """Join the trainer's store at `host:port` as `rank`, within `timeout_s`.

    A refused connection is retried until `timeout_s` (the trainer may not be
    listening yet), and so is a trainer that answers BUSY (too many handshakes
    in progress, a flood of stray connections); otherwise, once a process
    accepts, the handshake must complete within `handshake_timeout_s` and is
    never retried. Raises `StoreRefused` naming the
    address when the process there does not prove the secret or refuses this
    rank (logged at WARNING), `RuntimeError` naming it when nothing answers.
    """
    check_secret(secret, what="connect_store")
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        sock = _connect(host, port, rank, deadline, timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake_deadline = min(deadline, time.monotonic() + handshake_timeout_s)
            client_handshake(
                sock, secret=secret, trainer_id=trainer_id, rank=rank, deadline=handshake_deadline
            )
            break
        except TrainerBusy as e:
            sock.close()
            if time.monotonic() + 0.2 >= deadline:
                raise StoreRefused(
                    f"rank {rank} did not join through the store at {address} within "
                    f"{timeout_s:g}s: {e}"
                ) from None
            time.sleep(0.2)
        except HandshakeError as e:
            sock.close()
            logger.warning("rank %d refused the store at %s: %s", rank, address, e)
            raise StoreRefused(
                f"rank {rank} did not join through the store at {address}: {e}"
            ) from None
        except BaseException:
            sock.close()
            raise
    store = RemoteStore(sock, address, timeout_s)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
