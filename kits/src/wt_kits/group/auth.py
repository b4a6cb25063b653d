"""Mutual proof of a per-engine secret, then an authenticated session, on a store connection.

Every frame on the wire is a 4-byte big-endian length and that many bytes. The
handshake, for a worker claiming `rank` of the group of trainer `trainer_id`:

```
worker -> trainer   HELLO     MAGIC | rank (u32) | worker nonce (32 bytes)
trainer -> worker   CHALLENGE trainer nonce (32) | trainer proof (32)
worker -> trainer   PROOF     worker proof (32)
trainer -> worker   VERDICT   a session frame: 0 (admitted) | 1 (refused) + reason (UTF-8)
```

A proof is HMAC-SHA256 keyed by the secret over a role label, the trainer id,
the claimed rank and both nonces: each side proves it knows the secret for
this trainer and this rank in this connection, the labels keep a trainer proof
from passing as a worker proof, and fresh nonces keep an old proof from being
replayed. The worker checks the trainer's proof before it sends its own, so a
process that does not know the secret learns no worker proof, and a worker
pointed at such a process refuses it. A worker whose proof fails is told so in
a plain frame (1 + reason) and dropped.

Once the worker's proof checks, both sides hold a session key: the same HMAC
under the label "session" (never sent, and not computable from the proofs
without the secret). From the verdict on, every frame in either direction is a
session frame:

```
sequence (u64) | body | tag (16 bytes)
tag = HMAC-SHA256(session key, direction | sequence | body), first 16 bytes
direction = 0x01 worker -> trainer, 0x02 trainer -> worker
```

Each direction numbers its frames 0, 1, 2, ... (the trainer's verdict is its
frame 0). A receiver accepts only the frame numbered next in its direction with
a tag that checks, so a relay between the two can neither rewrite, inject,
reorder, replay nor reflect a frame, nor carry one over from another
connection, nor drop one without the next being refused: `Session.recv` raises
`FrameRefused` naming what failed, and the caller drops the connection.

Invariants: every handshake read has a deadline (a silent or slow peer ends in
`HandshakeError`); a frame longer than the caller's limit is refused before its
body is read; the secret and the session key never appear in a message.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import time

__all__ = [
    "SECRET_MIN_CHARS",
    "SECRET_MAX_CHARS",
    "MAX_HANDSHAKE_FRAME",
    "SESSION_OVERHEAD",
    "HandshakeError",
    "TrainerBusy",
    "FrameError",
    "FrameRefused",
    "PeerClosed",
    "Session",
    "new_secret",
    "check_secret",
    "send_frame",
    "recv_frame",
    "client_handshake",
    "server_handshake",
    "send_verdict",
]

SECRET_MIN_CHARS = 32
SECRET_MAX_CHARS = 1024
MAX_HANDSHAKE_FRAME = 256
MAGIC = b"wtstore1"
NONCE_BYTES = 32
TAG_BYTES = 16
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
# Bytes a session frame adds to its body: the sequence number and the tag.
SESSION_OVERHEAD = _SEQ.size + TAG_BYTES
_HELLO = struct.Struct(f">{len(MAGIC)}sI{NONCE_BYTES}s")
_MAC_BYTES = hashlib.sha256().digest_size
TO_TRAINER, TO_WORKER = b"\x01", b"\x02"
ADMITTED, REFUSED = 0, 1
BUSY = b"\x02"  # sent instead of a challenge when the trainer has no handshake slot free


class FrameError(ConnectionError):
    """The peer broke the framing: a frame too long, cut short or of the wrong shape."""


class PeerClosed(FrameError):
    """The peer closed the connection at a frame boundary (the way a client leaves)."""


class FrameRefused(FrameError):
    """A session frame that is not the peer's next one: a tag that does not check
    (rewritten, injected, reflected, from another connection) or the wrong
    sequence number (replayed, reordered, or one before it dropped)."""


class HandshakeError(RuntimeError):
    """The handshake failed; the message says why (never the secret)."""


class TrainerBusy(HandshakeError):
    """The trainer's store had too many handshakes in progress; try again shortly."""


def new_secret() -> str:
    """A fresh per-engine secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def check_secret(secret: object, *, what: str) -> str:
    """`secret` if it is usable, else `ValueError` naming field 'secret' of `what`.

    Usable: a `str` of `SECRET_MIN_CHARS` to `SECRET_MAX_CHARS` characters. The
    value itself is never quoted.
    """
    if not isinstance(secret, str) or not secret:
        raise ValueError(
            f"{what}: field 'secret' is missing or empty; group backends need the "
            "per-engine secret the trainer ships in the init payload (worker_group_fields)"
        )
    if not SECRET_MIN_CHARS <= len(secret) <= SECRET_MAX_CHARS:
        raise ValueError(
            f"{what}: field 'secret' must hold {SECRET_MIN_CHARS} to {SECRET_MAX_CHARS} "
            f"characters, got {len(secret)}"
        )
    return secret


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, what: str) -> bytes:
    """`n` bytes (of a `what`) from `sock`; `TimeoutError` past `deadline`, `PeerClosed`
    at EOF before the first byte, `FrameError` at EOF after it."""
    chunks: list[bytes] = []
    left = n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer sent nothing in time")
            sock.settimeout(remaining)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            raise TimeoutError("the peer sent nothing in time") from None
        if not chunk:
            if left == n:
                raise PeerClosed("the peer closed the connection")
            raise FrameError(f"the connection closed {n - left} bytes into a {n}-byte {what}")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, body: bytes, deadline: float | None) -> None:
    """Send one frame; `TimeoutError` if the peer does not take it before `deadline`."""
    if deadline is not None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the peer did not take the frame in time")
        sock.settimeout(remaining)
    else:
        sock.settimeout(None)
    try:
        sock.sendall(_LEN.pack(len(body)) + body)
    except TimeoutError:
        raise TimeoutError("the peer did not take the frame in time") from None


def recv_frame(
    sock: socket.socket, deadline: float | None, max_bytes: int, body_s: float | None = None
) -> bytes:
    """One frame's body; `FrameError` if its length field declares more than `max_bytes`.

    The length must arrive by `deadline` (None: no limit); the body by `deadline`
    too, or, when `body_s` is given, within `body_s` of the length if that is sooner.
    """
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, "frame length"))
    if size > max_bytes:
        raise FrameError(f"the frame length declares {size} bytes (at most {max_bytes} accepted)")
    if body_s is not None:
        body_deadline = time.monotonic() + body_s
        deadline = body_deadline if deadline is None else min(deadline, body_deadline)
    try:
        return _recv_exact(sock, size, deadline, "frame")
    except PeerClosed:
        raise FrameError(f"the connection closed inside a {size}-byte frame") from None
    except TimeoutError:
        raise FrameError(f"the rest of a {size}-byte frame did not arrive in time") from None


class Session:
    """The authenticated channel of one admitted connection (see the module doc).

    Not thread-safe: one sender and one receiver at a time (the store's
    client holds a lock per request; the server serves a connection on one
    thread). `recv` raises `FrameRefused` for a frame that is not the peer's
    next one, `FrameError` for one cut short or too long; after either the
    connection must be dropped (the numbering is lost).
    """

    def __init__(self, key: bytes, *, sends: bytes, receives: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._sends, self._receives = sends, receives
        self._sent = 0
        self._received = 0

    def _tag(self, direction: bytes, seq: bytes, body: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(direction + seq + body)
        return mac.digest()[:TAG_BYTES]

    def send(self, sock: socket.socket, body: bytes, deadline: float | None) -> None:
        """Send `body` as this side's next frame; `TimeoutError` past `deadline`."""
        seq = _SEQ.pack(self._sent)
        self._sent += 1
        send_frame(sock, seq + body + self._tag(self._sends, seq, body), deadline)

    def recv(
        self,
        sock: socket.socket,
        deadline: float | None,
        max_body: int,
        body_s: float | None = None,
    ) -> bytes:
        """The body of the peer's next frame (deadlines as `recv_frame`); raises
        `FrameRefused` if it is not that frame, `FrameError` if it is malformed."""
        frame = recv_frame(sock, deadline, max_body + SESSION_OVERHEAD, body_s)
        if len(frame) < SESSION_OVERHEAD:
            raise FrameError(
                f"a {len(frame)}-byte session frame (shorter than its sequence number and tag)"
            )
        seq, body, tag = frame[: _SEQ.size], frame[_SEQ.size : -TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self._receives, seq, body)):
            raise FrameRefused(
                f"frame {self._received} failed its tag (rewritten, injected or reflected "
                "on the way, or from another connection)"
            )
        (number,) = _SEQ.unpack(seq)
        if number != self._received:
            raise FrameRefused(
                f"frame number {number} came where {self._received} was due "
                "(replayed, reordered or one dropped on the way)"
            )
        self._received += 1
        return body


def _proof(
    secret: str, role: bytes, trainer_id: str, rank: int, ours: bytes, theirs: bytes
) -> bytes:
    message = b"\0".join((b"wt-store", role, trainer_id.encode(), str(rank).encode()))
    return hmac.new(secret.encode(), message + ours + theirs, hashlib.sha256).digest()


def _worker_proof(secret: str, trainer_id: str, rank: int, wn: bytes, tn: bytes) -> bytes:
    return _proof(secret, b"worker", trainer_id, rank, wn, tn)


def _trainer_proof(secret: str, trainer_id: str, rank: int, wn: bytes, tn: bytes) -> bytes:
    return _proof(secret, b"trainer", trainer_id, rank, wn, tn)


def _session_key(secret: str, trainer_id: str, rank: int, wn: bytes, tn: bytes) -> bytes:
    return _proof(secret, b"session", trainer_id, rank, wn, tn)


def client_handshake(
    sock: socket.socket, *, secret: str, trainer_id: str, rank: int, deadline: float
) -> Session:
    """Prove the secret to the trainer as `rank`, after it proved it to us; the session.

    Raises `HandshakeError` when the peer does not prove the secret, refuses
    us (the reason is the trainer's), breaks the framing or runs past
    `deadline`. The caller names the address.
    """
    worker_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        send_frame(sock, _HELLO.pack(MAGIC, rank, worker_nonce), deadline)
        challenge = recv_frame(sock, deadline, MAX_HANDSHAKE_FRAME)
        if challenge == BUSY:
            raise TrainerBusy("the trainer's store is busy with other handshakes")
        if len(challenge) != NONCE_BYTES + _MAC_BYTES:
            raise HandshakeError(
                "it answered with something other than a wt store challenge "
                "(it is not a wt trainer, or a different version)"
            )
        trainer_nonce, their_proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
        want = _trainer_proof(secret, trainer_id, rank, worker_nonce, trainer_nonce)
        if not hmac.compare_digest(their_proof, want):
            raise HandshakeError(
                f"it did not prove this engine's secret for trainer {trainer_id!r} "
                "(it is not the trainer that sent this init)"
            )
        ours = _worker_proof(secret, trainer_id, rank, worker_nonce, trainer_nonce)
        send_frame(sock, ours, deadline)
        key = _session_key(secret, trainer_id, rank, worker_nonce, trainer_nonce)
        session = Session(key, sends=TO_TRAINER, receives=TO_WORKER)
        verdict = session.recv(sock, deadline, MAX_HANDSHAKE_FRAME)
    except TimeoutError:
        raise HandshakeError("it did not complete the handshake in time") from None
    except FrameError as e:
        raise HandshakeError(f"the handshake broke off: {e}") from None
    except OSError as e:
        raise HandshakeError(f"the handshake failed: {e}") from None
    if not verdict or verdict[0] not in (ADMITTED, REFUSED):
        raise HandshakeError("it answered the handshake with a malformed verdict")
    if verdict[0] == REFUSED:
        reason = verdict[1:].decode("utf-8", "replace")
        raise HandshakeError(f"the trainer refused rank {rank}: {reason}")
    return session


def server_handshake(
    sock: socket.socket, *, secret: str, trainer_id: str, deadline: float
) -> tuple[int, Session]:
    """Check a connecting worker's proof; the rank it proved the secret for, and the session.

    The caller decides admission (rank range, duplicates) and sends the verdict
    with `send_verdict`. Raises `HandshakeError` naming the reason: a bad
    secret (the claimed rank is named), a malformed frame, a peer that closed,
    or `deadline` passed.
    """
    try:
        hello = recv_frame(sock, deadline, MAX_HANDSHAKE_FRAME)
        if len(hello) != _HELLO.size:
            raise HandshakeError(f"malformed frame: a {len(hello)}-byte hello")
        magic, rank, worker_nonce = _HELLO.unpack(hello)
        if magic != MAGIC:
            raise HandshakeError("malformed frame: not a wt store hello")
        trainer_nonce = secrets.token_bytes(NONCE_BYTES)
        proof = _trainer_proof(secret, trainer_id, rank, worker_nonce, trainer_nonce)
        send_frame(sock, trainer_nonce + proof, deadline)
        theirs = recv_frame(sock, deadline, MAX_HANDSHAKE_FRAME)
    except TimeoutError:
        raise HandshakeError("handshake timeout: the peer did not complete it in time") from None
    except PeerClosed:
        raise HandshakeError("the peer closed the connection during the handshake") from None
    except FrameError as e:
        raise HandshakeError(f"malformed frame: {e}") from None
    except OSError as e:
        raise HandshakeError(f"the connection failed during the handshake: {e}") from None
    want = _worker_proof(secret, trainer_id, rank, worker_nonce, trainer_nonce)
    if len(theirs) != _MAC_BYTES or not hmac.compare_digest(theirs, want):
        _refuse_quietly(sock, deadline, "refused")
        raise HandshakeError(f"bad secret (it claimed rank {rank})")
    key = _session_key(secret, trainer_id, rank, worker_nonce, trainer_nonce)
    return int(rank), Session(key, sends=TO_WORKER, receives=TO_TRAINER)


def send_verdict(
    sock: socket.socket, session: Session, deadline: float, refusal: str | None
) -> None:
    """Tell the worker, as the session's first frame, it is admitted (`refusal` None) or why not."""
    if refusal is None:
        session.send(sock, bytes([ADMITTED]), deadline)
    else:
        reason = refusal.encode()[: MAX_HANDSHAKE_FRAME - 1]
        session.send(sock, bytes([REFUSED]) + reason, deadline)


def _refuse_quietly(sock: socket.socket, deadline: float, refusal: str) -> None:
    """Best-effort plain refusal to a peer that did not prove the secret (no session)."""
    with contextlib.suppress(OSError):
        send_frame(sock, bytes([REFUSED]) + refusal.encode()[: MAX_HANDSHAKE_FRAME - 1], deadline)
