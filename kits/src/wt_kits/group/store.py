"""The private group's rendezvous store: admits only workers that prove the secret.

`StoreServer` (trainer rank 0) listens on exactly the address it is given and
serves an in-memory key table; `server.store` is rank 0's own view of it.
`connect_store(...)` (a worker) connects, runs the mutual handshake of
`kits/group/auth.py` and returns a `RemoteStore`. Both stores are
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

After the handshake every request and answer is one session frame of
`kits/group/auth.py` (numbered, and tagged with the connection's session key),
whose body is a code byte and fields, each a u32 length and that many bytes:

```
request  op (1 byte) | fields          answer  status (1 byte) | fields
set          key, value                OK       the op's result fields
get          key, wait_ms              TIMEOUT  (get, wait: not there in time)
add          key, amount               ERROR    reason (the connection stays)
check        key, ...                  DROPPED  reason (the server drops it)
wait         wait_ms, key, ...
delete       key
compare_set  key, expected, desired
num_keys     (none)
```

A key is UTF-8 of at most `MAX_KEY_BYTES`; `wait_ms` a decimal integer in
`[0, WAIT_SLICE_S * 1000]`; `amount` a decimal integer in the signed 64-bit
range; a request at most `MAX_FRAME_BYTES`. A frame that breaks any of these
(an unknown op, a wrong field count, a length past the frame's end, a key not
UTF-8 or too long, a number out of range or not decimal), or that fails its
session tag or sequence number (a relay rewrote, injected, replayed, reordered
or dropped a frame), is refused: logged at WARNING naming the peer, the rank
and the field or check that failed, answered DROPPED with that reason (tagged,
so a relay cannot forge it) and the connection closed. The worker's side
refuses an answer that fails its check the same way: it logs, drops the
connection and raises `DistStoreError` naming the address and what failed. No
input ends a connection's thread other than through that refusal; a bug that
would is caught at the thread's top and logged at ERROR, and only that
connection closes.

Requests that wait (get, wait) wait at most `WAIT_SLICE_S` at the server; the
client repeats them until its own timeout, so no request holds a connection
long and every wait is bounded. The table holds at most `MAX_TABLE_KEYS` keys
and `MAX_TABLE_BYTES` of keys and values; a request beyond that is answered
ERROR. `close()` closes the listening socket at once (it is bound with
`SO_REUSEADDR`, so the next rendezvous can bind the same port) and every
connection, which the workers see as the trainer gone.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from wt_kits.group.auth import (
    BUSY,
    FrameError,
    FrameRefused,
    HandshakeError,
    PeerClosed,
    Session,
    TrainerBusy,
    check_secret,
    client_handshake,
    send_frame,
    send_verdict,
    server_handshake,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_PENDING_HANDSHAKES",
    "WAIT_SLICE_S",
    "MAX_FRAME_BYTES",
    "MAX_KEY_BYTES",
    "MAX_TABLE_KEYS",
    "MAX_TABLE_BYTES",
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
_MAX_WAIT_MS = int(WAIT_SLICE_S * 1000)
# Largest request or answer body (gloo and NCCL exchange addresses and ids of a few hundred bytes).
MAX_FRAME_BYTES = 1 << 20
# Largest key; gloo's and NCCL's keys are a prefix and a few dozen characters.
MAX_KEY_BYTES = 4096
# What the table holds at most (a rendezvous of hundreds of ranks needs a few hundred KiB).
MAX_TABLE_KEYS = 1 << 16
MAX_TABLE_BYTES = 64 << 20
_MAX_FIELDS = 4096
_INT64 = (-(1 << 63), (1 << 63) - 1)
_DECIMAL = re.compile(rb"-?[0-9]{1,19}")
# Time an answer may take beyond the wait it asked for, at most; and the rest of a
# frame once its length arrived.
_IO_GRACE_S = 10.0
# Time the server gives its last answer (the reason it drops a connection).
_LAST_WORD_S = 1.0

_SET, _GET, _ADD, _CHECK, _WAIT, _DELETE, _COMPARE_SET, _NUM_KEYS = range(1, 9)
_OP_NAMES = {
    _SET: "set",
    _GET: "get",
    _ADD: "add",
    _CHECK: "check",
    _WAIT: "wait",
    _DELETE: "delete",
    _COMPARE_SET: "compare_set",
    _NUM_KEYS: "num_keys",
}
_OK, _TIMEOUT, _ERROR, _DROPPED = range(4)
_LEN = struct.Struct(">I")
T = TypeVar("T")


class StoreRefused(RuntimeError):
    """A worker would not join through this store, or the trainer would not admit it."""


class StoreClosed(RuntimeError):
    """The table was closed (its group is gone)."""


class StoreFull(ValueError):
    """The table holds `MAX_TABLE_KEYS` keys or `MAX_TABLE_BYTES` already."""


def _encode(code: int, fields: Sequence[bytes]) -> bytes:
    return bytes([code]) + b"".join(_LEN.pack(len(f)) + f for f in fields)


def _decode(body: bytes) -> tuple[int, list[bytes]]:
    """`(code, fields)` of a request or answer; `FrameError` naming the field if it is not one."""
    if not body:
        raise FrameError("field 'op': an empty frame")
    fields: list[bytes] = []
    at = 1
    while at < len(body):
        if len(fields) == _MAX_FIELDS:
            raise FrameError(f"field count: more than {_MAX_FIELDS} fields")
        if at + _LEN.size > len(body):
            raise FrameError(f"field {len(fields)}: its length is cut off by the frame's end")
        (size,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if size > len(body) - at:
            raise FrameError(
                f"field {len(fields)}: its length declares {size} bytes, "
                f"{len(body) - at} are left in the frame"
            )
        fields.append(body[at : at + size])
        at += size
    return body[0], fields


def _show(field: bytes) -> str:
    """`field` for a message: short ones whole, long ones cut (with their size)."""
    if len(field) <= 24:
        return repr(field)
    return f"{field[:16]!r}... ({len(field)} bytes)"


def _key(op: str, name: str, field: bytes) -> str:
    """A key field; `FrameError` naming it if too long or not UTF-8."""
    if len(field) > MAX_KEY_BYTES:
        raise FrameError(
            f"field {name!r} of {op}: a {len(field)}-byte key (at most {MAX_KEY_BYTES})"
        )
    try:
        return field.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(f"field {name!r} of {op}: {_show(field)} is not UTF-8") from None


def _decimal(data: bytes, low: int, high: int) -> int | None:
    """`data` as a decimal integer in `[low, high]` (at most 19 digits, an optional
    minus, nothing else), or None."""
    if _DECIMAL.fullmatch(data) is None:
        return None
    value = int(data)
    return value if low <= value <= high else None


def _integer(op: str, name: str, field: bytes, low: int, high: int) -> int:
    """A decimal integer field in `[low, high]`; `FrameError` naming it otherwise."""
    value = _decimal(field, low, high)
    if value is None:
        raise FrameError(
            f"field {name!r} of {op}: {_show(field)} is not a decimal integer in [{low}, {high}]"
        )
    return value


def _wait_s(op: str, field: bytes) -> float:
    return _integer(op, "wait_ms", field, 0, _MAX_WAIT_MS) / 1000


def _arity(op: str, fields: Sequence[bytes], count: int) -> None:
    if len(fields) != count:
        raise FrameError(f"field count of {op}: {len(fields)} fields where {count} are due")


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key_bytes(key: str) -> bytes:
    """`key` as sent; `ValueError` if it is longer than the server accepts."""
    data = key.encode()
    if len(data) > MAX_KEY_BYTES:
        raise ValueError(f"a store key of {len(data)} bytes (at most {MAX_KEY_BYTES})")
    return data


class KeyTable:
    """The store's keys; thread-safe. Waits are bounded by the caller's `wait_s`.

    Holds at most `MAX_TABLE_KEYS` keys and `MAX_TABLE_BYTES` (keys and values);
    a write beyond that raises `StoreFull`. After `close()` every operation (and
    every wait in progress) raises `StoreClosed`.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise StoreClosed("the trainer's store is closed (its group is gone)")

    def _wait_for(self, ready: Callable[[], bool], wait_s: float) -> bool:
        ok = self._cond.wait_for(lambda: self._closed or ready(), max(0.0, wait_s))
        self._open()
        return ok

    def _put(self, key: str, value: bytes) -> None:
        """Set `key` (the lock held); `StoreFull` if the table has no room for it."""
        old = self._data.get(key)
        size = len(value) - (len(old) if old is not None else -len(key.encode()))
        if old is None and len(self._data) >= MAX_TABLE_KEYS:
            raise StoreFull(f"the store holds {MAX_TABLE_KEYS} keys already")
        if self._bytes + size > MAX_TABLE_BYTES:
            raise StoreFull(f"the store would hold more than {MAX_TABLE_BYTES} bytes")
        self._data[key] = value
        self._bytes += size
        self._cond.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._open()
            self._put(key, value)

    def get(self, key: str, wait_s: float) -> bytes | None:
        """The value of `key`, waiting up to `wait_s` for it; None if it is still missing."""
        with self._cond:
            self._open()
            if not self._wait_for(lambda: key in self._data, wait_s):
                return None
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the decimal integer at `key` (0 if missing); the new value.

        `ValueError` if the key holds something other than a signed 64-bit
        decimal or the sum leaves that range (the key is left as it was).
        """
        with self._cond:
            self._open()
            current = _decimal(self._data.get(key, b"0"), *_INT64)
            if current is None:
                raise ValueError(f"key {key!r} does not hold a 64-bit integer")
            value = current + amount
            if not _INT64[0] <= value <= _INT64[1]:
                raise ValueError(f"adding {amount} to key {key!r} leaves the 64-bit range")
            self._put(key, str(value).encode())
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
            old = self._data.pop(key, None)
            if old is None:
                return False
            self._bytes -= len(key.encode()) + len(old)
            return True

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """`TCPStore`'s rule: set `desired` if `key` holds `expected` (or is missing and
        `expected` is empty); returns the value the key holds afterwards (for a missing
        key and a non-empty `expected`: `expected`)."""
        with self._cond:
            self._open()
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._put(key, desired)
                return desired
            return expected if current is None else current

    def num_keys(self) -> int:
        with self._cond:
            self._open()
            return len(self._data)

    def snapshot(self) -> dict[str, bytes]:
        """A copy of every key and value (also after `close()`)."""
        with self._cond:
            return dict(self._data)

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

    Every request and answer is a frame of `session` (see the module doc). A
    connection that fails, breaks the framing or delivers an answer that fails
    its session check (logged at WARNING) is dropped, and that call and every
    later one raise `DistStoreError` naming the address. A request the server
    would refuse as malformed (a key over `MAX_KEY_BYTES`, an amount outside
    64 bits, over `MAX_FRAME_BYTES` in all) raises `ValueError` before it is sent.
    """

    def __init__(
        self, sock: socket.socket, session: Session, address: str, rank: int, timeout_s: float
    ) -> None:
        super().__init__()
        self._sock: socket.socket | None = sock
        self._session = session
        self.address = address
        self._rank = rank
        self._lock = threading.Lock()
        self._io_s = min(timeout_s, _IO_GRACE_S)

    def _call(
        self, code: int, fields: Sequence[bytes], wait_s: float = 0.0
    ) -> tuple[int, list[bytes]]:
        request = _encode(code, fields)
        if len(request) > MAX_FRAME_BYTES:
            raise ValueError(
                f"a store {_OP_NAMES[code]} request of {len(request)} bytes "
                f"(at most {MAX_FRAME_BYTES})"
            )
        with self._lock:
            sock = self._sock
            if sock is None:
                raise dist.DistStoreError(
                    f"the connection to the trainer's store at {self.address} is closed"
                )
            deadline = time.monotonic() + wait_s + self._io_s
            try:
                self._session.send(sock, request, deadline)
                status, answer = _decode(self._session.recv(sock, deadline, MAX_FRAME_BYTES))
            except FrameRefused as e:
                self._drop()
                logger.warning(
                    "rank %d dropped the trainer's store at %s: an answer failed "
                    "authentication: %s",
                    self._rank,
                    self.address,
                    e,
                )
                raise dist.DistStoreError(
                    f"the trainer's store at {self.address} sent an answer that failed "
                    f"authentication ({e}); the connection is dropped"
                ) from None
            except OSError as e:  # timeouts and framing errors included
                self._drop()
                raise dist.DistStoreError(
                    f"the trainer's store at {self.address} stopped answering: {e}"
                ) from None
            if status == _DROPPED:
                self._drop()
        if status in (_ERROR, _DROPPED):
            reason = answer[0].decode("utf-8", "replace") if answer else "no reason"
            raise dist.DistStoreError(f"the trainer's store at {self.address} refused: {reason}")
        if status not in (_OK, _TIMEOUT):
            raise self._malformed(_OP_NAMES[code], f"status {status}")
        return status, answer

    def _malformed(self, op: str, what: str) -> dist.DistStoreError:
        """Drop the connection; the error for an answer to `op` of the wrong shape."""
        with self._lock:
            self._drop()
        return dist.DistStoreError(
            f"the trainer's store at {self.address} answered {op} with {what}; "
            "the connection is dropped"
        )

    def _single(self, op: str, answer: list[bytes]) -> bytes:
        if len(answer) != 1:
            raise self._malformed(op, f"{len(answer)} fields where 1 is due")
        return answer[0]

    def _flag(self, op: str, answer: list[bytes]) -> bool:
        value = self._single(op, answer)
        if value not in (b"0", b"1"):
            raise self._malformed(op, f"{_show(value)} where 0 or 1 is due")
        return value == b"1"

    def _int64(self, op: str, answer: list[bytes]) -> int:
        value = self._single(op, answer)
        number = _decimal(value, *_INT64)
        if number is None:
            raise self._malformed(op, f"{_show(value)} where a 64-bit integer is due")
        return number

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
        status, answer = self._call(_GET, [_key_bytes(key), wait_ms], wait_s)
        return None if status == _TIMEOUT else self._single("get", answer)

    def _wait_once(self, keys: Sequence[str], wait_s: float) -> bool:
        wait_ms = str(int(wait_s * 1000)).encode()
        status, _ = self._call(_WAIT, [wait_ms, *map(_key_bytes, keys)], wait_s)
        return status == _OK

    def set(self, key: str, value: str | bytes) -> None:
        self._call(_SET, [_key_bytes(key), _as_bytes(value)])

    def add(self, key: str, amount: int) -> int:
        if not _INT64[0] <= int(amount) <= _INT64[1]:
            raise ValueError(f"store add of {amount} (the amount must fit in 64 bits)")
        _, answer = self._call(_ADD, [_key_bytes(key), str(int(amount)).encode()])
        return self._int64("add", answer)

    def check(self, keys: list[str]) -> bool:
        _, answer = self._call(_CHECK, [_key_bytes(k) for k in keys])
        return self._flag("check", answer)

    def delete_key(self, key: str) -> bool:
        _, answer = self._call(_DELETE, [_key_bytes(key)])
        return self._flag("delete", answer)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        fields = [_key_bytes(key), _as_bytes(expected), _as_bytes(desired)]
        _, answer = self._call(_COMPARE_SET, fields)
        return self._single("compare_set", answer)

    def num_keys(self) -> int:
        _, answer = self._call(_NUM_KEYS, [])
        return self._int64("num_keys", answer)


def _serve_request(table: KeyTable, code: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
    """One request against `table`; `FrameError` naming the field if it is malformed,
    `ValueError` if the table refuses it (see `KeyTable`)."""
    op = _OP_NAMES.get(code)
    if op is None:
        raise FrameError(f"field 'op': unknown op {code}")
    if code == _SET:
        _arity(op, fields, 2)
        table.set(_key(op, "key", fields[0]), fields[1])
        return _OK, []
    if code == _GET:
        _arity(op, fields, 2)
        value = table.get(_key(op, "key", fields[0]), _wait_s(op, fields[1]))
        return (_TIMEOUT, []) if value is None else (_OK, [value])
    if code == _ADD:
        _arity(op, fields, 2)
        key, amount = _key(op, "key", fields[0]), _integer(op, "amount", fields[1], *_INT64)
        return _OK, [str(table.add(key, amount)).encode()]
    if code == _CHECK:
        keys = [_key(op, f"key {i}", f) for i, f in enumerate(fields)]
        return _OK, [b"1" if table.check(keys) else b"0"]
    if code == _WAIT:
        if not fields:
            raise FrameError("field count of wait: no wait_ms")
        wait_s = _wait_s(op, fields[0])
        keys = [_key(op, f"key {i}", f) for i, f in enumerate(fields[1:])]
        return (_OK, []) if table.wait(keys, wait_s) else (_TIMEOUT, [])
    if code == _DELETE:
        _arity(op, fields, 1)
        return _OK, [b"1" if table.delete(_key(op, "key", fields[0])) else b"0"]
    if code == _COMPARE_SET:
        _arity(op, fields, 3)
        return _OK, [table.compare_set(_key(op, "key", fields[0]), fields[1], fields[2])]
    _arity(op, fields, 0)  # num_keys
    return _OK, [str(table.num_keys()).encode()]


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

    @property
    def connections(self) -> int:
        """The connections being served (in their handshake or admitted)."""
        with self._lock:
            return len(self._connections)

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
            try:
                self._take(conn, _peer_name(peer))
            except Exception:  # e.g. no thread could be started: only this connection is lost
                logger.error(
                    "wt store %s could not serve %s", self._name, _peer_name(peer), exc_info=True
                )
                with self._lock:
                    if conn in self._connections:
                        self._connections.discard(conn)
                        self._pending -= 1
                conn.close()

    def _take(self, conn: socket.socket, name: str) -> None:
        """Start `conn`'s own thread, or tell it BUSY (too many handshakes) and close it."""
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
            return
        threading.Thread(
            target=self._serve, args=(conn, name), name=f"wt-store-conn-{name}", daemon=True
        ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """A connection's thread: nothing escapes it (a bug is logged at ERROR)."""
        try:
            admitted = self._admit(conn, peer)
            if admitted is not None:
                self._requests(conn, peer, *admitted)
        except OSError:
            pass  # the connection broke, or close() shut it
        except Exception:
            logger.error(
                "wt store %s dropped %s: its connection failed", self._name, peer, exc_info=True
            )
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket, peer: str) -> tuple[int, Session] | None:
        """The rank `conn` proved and was admitted for and its session, or None
        (refused, logged)."""
        deadline = time.monotonic() + self._handshake_s
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rank, session = server_handshake(
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
        send_verdict(conn, session, deadline, refusal)
        if refusal is not None:
            self._refused(peer, refusal)
            return None
        logger.debug("wt store %s admitted rank %d from %s", self._name, rank, peer)
        return rank, session

    def _requests(self, conn: socket.socket, peer: str, rank: int, session: Session) -> None:
        """Serve `rank`'s requests until it leaves or sends a frame that is refused."""
        while True:
            try:
                body = session.recv(conn, None, MAX_FRAME_BYTES, body_s=_IO_GRACE_S)
                code, fields = _decode(body)
                status, answer = _serve_request(self.table, code, fields)
            except PeerClosed:
                return
            except FrameError as e:
                if not self._closed:
                    self._drop(conn, peer, rank, session, e)
                return
            except StoreClosed:
                return
            except ValueError as e:  # the table's refusal: answered, the connection stays
                self._refused(peer, f"rank {rank}'s request: {e}")
                status, answer = _ERROR, [str(e).encode()]
            session.send(conn, _encode(status, answer), time.monotonic() + _IO_GRACE_S)

    def _drop(
        self, conn: socket.socket, peer: str, rank: int, session: Session, error: FrameError
    ) -> None:
        """Log why `rank`'s connection is dropped and tell it (tagged, best effort)."""
        kind = "failed authentication" if isinstance(error, FrameRefused) else "was malformed"
        reason = f"rank {rank} sent a frame that {kind} ({error}); dropped the connection"
        self._refused(peer, reason)
        with contextlib.suppress(OSError):
            answer = _encode(_DROPPED, [reason.encode()])
            session.send(conn, answer, time.monotonic() + _LAST_WORD_S)

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
            session = client_handshake(
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
    store = RemoteStore(sock, session, address, rank, timeout_s)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
