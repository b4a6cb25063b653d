"""A control link between colocated processes: fixed-size frames over a Unix socket.

The bytes of a colocated transfer go through shared memory; this link
carries only what says where they are and when: `Frame(kind, round_id,
index, value)`, four little-endian int64 (32 bytes). Meanings belong to the
backend; `round_id` lets each side skip frames left over from a round that
ended early, so a link never falls out of step and never needs tearing down
after a failed round.

Trainer: `LocalListener()` binds `control` in a fresh private directory
(mode 0700, unguessable name); `accept(timeout_s)` returns a `LocalLink`
whose `peer_pid` / `peer_uid` come from the kernel (`SO_PEERCRED`), not
from anything the peer says. `close()` removes the socket and its
directory.

Worker: `connect_local(path, timeout_s)` reaches it.

Peer death: the kernel closes a dead process's socket, so a read waiting on
it ends at once with `LinkClosed` (no timeout needed to notice a `kill -9`).
Every read is bounded by its `timeout_s` (`TransferTimeout`).

`Credits` is a trainer's end of all its links: `send(frame)` goes to every
worker, and `released(round_id, k)` is a future that completes once every
link has reported (with a `RELEASED` frame of value `v` meaning "buckets
below `v` are free") that bucket `k` is free, and fails with `LinkClosed`
naming the worker as soon as one link closes. It is a `GroupChannel` link.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from weight_transfer.runtime.waiting import TransferTimeout

__all__ = [
    "Frame",
    "LocalLink",
    "LocalListener",
    "LinkClosed",
    "connect_local",
    "Credits",
    "RELEASED",
]

_FRAME = struct.Struct("<4q")
RELEASED = 3  # the one frame kind `Credits` reads: value = first bucket still held


class LinkClosed(ConnectionError):
    """The peer closed the link (it shut down or died)."""


@dataclass(frozen=True)
class Frame:
    kind: int
    round_id: int
    index: int
    value: int


class LocalLink:
    """One connected Unix socket, with the kernel's word on who is at the other end."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.peer_pid, self.peer_uid, _ = struct.unpack("3i", creds)
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, frame: Frame) -> None:
        data = _FRAME.pack(frame.kind, frame.round_id, frame.index, frame.value)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise LinkClosed(f"{self.name} closed the control link ({e})") from e

    def recv(self, timeout_s: float | None, what: str) -> Frame:
        """The next frame, within `timeout_s` (None: no limit); `LinkClosed` if the peer is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if deadline is None:
            self.sock.settimeout(None)
        data = b""
        while len(data) < _FRAME.size:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"{what} did not arrive within {timeout_s:g}s")
                self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(_FRAME.size - len(data))
            except TimeoutError:
                continue
            except OSError as e:
                raise LinkClosed(f"{self.name} closed the control link ({e})") from e
            if not chunk:
                raise LinkClosed(
                    f"{self.name} closed the control link while this side waited for {what} "
                    "(it died or shut down)"
                )
            data += chunk
        return Frame(*_FRAME.unpack(data))

    def peer_alive(self) -> bool:
        """Whether the peer still has its end open; one that closed it (or died) is gone
        even while frames it sent are still unread here."""
        if self.closed:
            return False
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    # The `GroupChannel` link protocol.
    def abort(self) -> None:
        self.close()

    def trainer_alive(self) -> bool:
        return self.peer_alive()


class LocalListener:
    """The trainer's listening socket in a private directory; see the module docstring."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="wt-ipc-")  # mode 0700, random name
        self.path = os.path.join(self.directory, "control")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self.sock.listen(64)
        except BaseException:
            self.close()
            raise

    def accept(self, timeout_s: float) -> LocalLink | None:
        """The next connection within `timeout_s`, or None."""
        self.sock.settimeout(max(timeout_s, 1e-6))
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return None
        conn.settimeout(None)
        link = LocalLink(conn, "a worker")
        link.name = f"worker pid {link.peer_pid}"
        return link

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def connect_local(path: str, timeout_s: float) -> LocalLink:
    """Connect to the listener at `path` (the peer is named "the trainer")."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise ConnectionError(f"could not reach the trainer's control socket {path!r}: {e}") from e
    sock.settimeout(None)
    return LocalLink(sock, "the trainer")


class Credits:
    """Futures for "every worker released bucket k"; see the module docstring.

    One daemon reader per link. `round_id` frames older than the newest asked
    for are skipped. `closed_link()` names the first link that closed.
    """

    def __init__(self, links: list[LocalLink]) -> None:
        self.links = links
        self._lock = threading.Lock()
        self._round = -1
        self._released = [0] * len(links)
        self._waiting: list[tuple[int, int, Future[None]]] = []
        self.failure: LinkClosed | None = None
        for i, link in enumerate(links):
            threading.Thread(
                target=self._read, args=(i, link), name="wt-ipc-credits", daemon=True
            ).start()

    def begin(self, round_id: int) -> None:
        """Count releases for `round_id` from now on."""
        with self._lock:
            self._round = round_id
            self._released = [0] * len(self.links)
            for _, _, future in self._waiting:
                future.cancel()
            self._waiting = []

    def released(self, round_id: int, k: int) -> Future[None]:
        """Completes once every link has released bucket `k` of `round_id`."""
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self.failure is not None:
                future.set_exception(self.failure)
            elif round_id == self._round and min(self._released) > k:
                future.set_result(None)
            else:
                self._waiting.append((round_id, k, future))
        return future

    def _read(self, i: int, link: LocalLink) -> None:
        while True:
            try:
                frame = link.recv(None, "a release")
            except (LinkClosed, TransferTimeout) as e:
                self._fail(LinkClosed(str(e)))
                return
            if frame.kind != RELEASED:
                continue
            with self._lock:
                if frame.round_id != self._round:
                    continue
                self._released[i] = max(self._released[i], frame.value)
                floor = min(self._released)
                still = []
                for round_id, k, future in self._waiting:
                    if round_id == self._round and floor > k:
                        future.set_result(None)
                    else:
                        still.append((round_id, k, future))
                self._waiting = still

    def send(self, frame: Frame) -> None:
        """Send `frame` to every worker; `LinkClosed` (and the credits fail) if one is gone."""
        for link in self.links:
            try:
                link.send(frame)
            except LinkClosed as error:
                self._fail(error)
                raise

    @property
    def healthy(self) -> bool:
        """No link has closed."""
        return self.failure is None

    def _fail(self, error: LinkClosed) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
            waiting, self._waiting = self._waiting, []
        for _, _, future in waiting:
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        for link in self.links:
            link.close()

    # The `GroupChannel` link protocol (the trainer's side: always its own end).
    def abort(self) -> None:
        self.close()

    def trainer_alive(self) -> bool:
        return True
