"""Generation around a round, seen from a worker: the vLLM engine core that runs it.

A trainer's client pauses generation before a round and resumes it after.
When the trainer dies mid-round that resume never comes; the worker engine
rolls its round back by itself and resumes generation through `Generation`
(see `WeightTransferEngine`), if the pause was in force when the round began.

The engine core is reached one of two ways (`Generation.of_caller`, called
from a worker's control call, which vLLM always runs from its engine core):

- in the same process (vLLM's `uni` executor: an in-process `LLM`, a one-GPU
  server), the engine core is found on the calling thread's stack;
- from a worker process of its own (the multiprocess executor: vLLM's choice
  on CPU, and for tensor parallelism), the worker asks its parent process,
  the engine core, over a Unix socket in the abstract namespace that
  `serve_generation` (started by wt's vLLM plugin in every vLLM process)
  listens on: one request per connection, an op byte and its argument (`?`
  reads the pause state, `!` resumes, `L` reads the weight version label, `S`
  sets it to the UTF-8 argument, `V` votes to resume (argument
  `<round>:<rank>:<world_size>`: the engine core resumes once every worker
  voted for the round), `A` / `D` tell the engine core that the LoRA adapter
  named by the argument is served / no longer served: `gate`); the answer is
  the rest of the stream. The service answers only a child process of the same
  user (`SO_PEERCRED`).

An engine of several workers (tensor or pipeline parallel) resumes only when
all of its workers ask (`resume_when_all`): each rolls its own round back, and
one worker's resume would run requests while another still restores its
weights.

Data-parallel engine cores' generation is left alone (their resume is a
collective across ranks): it stays paused until a trainer or an operator
resumes it. Their adapter gate is kept as any engine core's.

Version-pinned to vLLM 0.32's engine core: `is_scheduler_paused()`, the
scheduler's pause state, `input_queue` with its `WAKEUP` request, and
`get_weight_version` / `set_weight_version` (the label lives in the engine core).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Any

__all__ = ["Generation", "serve_generation"]

logger = logging.getLogger("weight_transfer")

_ADDRESS = "\0wt-generation-{pid}"
_ASK_TIMEOUT_S = 2.0
_MAX_MESSAGE = 4096
QUERY, RESUME, LABEL, SET_LABEL = b"?", b"!", b"L", b"S"
ADAPTER_SERVED, ADAPTER_DROPPED, VOTE = b"A", b"D", b"V"
PAUSED, RUNNING, DONE, UNKNOWN, DATA_PARALLEL = b"P", b"U", b"R", b"N", b"M"


class Generation:
    """The pause state of the vLLM engine core that runs this worker."""

    def __init__(self, core: Any = None, *, parent: int | None = None) -> None:
        self._core = core
        self._parent = parent

    @classmethod
    def of_caller(cls, *, data_parallel: bool = False) -> Generation | None:
        """The engine core calling this worker (on this thread's stack, else this
        process's parent), or None when neither is one that wt can resume;
        `data_parallel`: a data-parallel engine core too (for its adapter gate
        alone: `adapter_served`)."""
        core = _core_on_stack()
        if core is not None:
            return None if _data_parallel(core) and not data_parallel else cls(core)
        parent = cls(parent=os.getppid())
        answer = parent._ask(QUERY)
        if answer in (PAUSED, RUNNING) or (data_parallel and answer == DATA_PARALLEL):
            return parent
        return None

    def paused(self) -> bool | None:
        """Whether generation is paused (by anyone); None when the engine core gives no
        answer (a caller then decides nothing on it)."""
        if self._core is not None:
            return bool(self._core.is_scheduler_paused())
        answer = self._ask(QUERY)
        return True if answer == PAUSED else False if answer == RUNNING else None

    def resume(self) -> None:
        """Resume generation; safe from any thread."""
        if self._core is not None:
            _resume(self._core)
        elif self._ask(RESUME) != DONE:
            logger.warning("the engine core did not confirm it resumed generation")

    def resume_when_all(self, round_id: int, rank: int, world_size: int) -> None:
        """Resume once each of the engine's `world_size` workers asked for round
        `round_id` (at once for an engine of one worker)."""
        if world_size == 1:
            self.resume()
        elif self._core is not None:
            _vote(self._core, round_id, rank, world_size)
        elif self._ask(VOTE + f"{round_id}:{rank}:{world_size}".encode()) != DONE:
            logger.warning("the engine core did not take this worker's resume")

    def label(self) -> str | None:
        """The engine's weight version label (None when it cannot be read)."""
        if self._core is not None:
            return str(self._core.get_weight_version())
        answer = self._ask(LABEL)
        return answer[1:].decode() if answer[:1] == DONE else None

    def set_label(self, label: str) -> None:
        """Set the weight version label (a round rolled back gives the old one back)."""
        if self._core is not None:
            self._core.set_weight_version(label)
        elif self._ask(SET_LABEL + label.encode()) != DONE:
            logger.warning("the engine core did not confirm it set the label %r", label)

    def adapter_served(self, name: str, served: bool) -> None:
        """Tell the engine core whether it serves the wt LoRA adapter `name`, so
        that it admits requests naming it, or fails them alone (`gate`)."""
        if self._core is not None:
            from weight_transfer.vllm import gate

            gate.set_served(self._core, name, served)
            return
        op = ADAPTER_SERVED if served else ADAPTER_DROPPED
        if self._ask(op + name.encode()) != DONE:
            logger.warning("the engine core did not confirm adapter %r is %s", name, op)

    def _ask(self, request: bytes) -> bytes:
        """The parent's answer to `request`; UNKNOWN when it gives none."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(_ASK_TIMEOUT_S)
                sock.connect(_ADDRESS.format(pid=self._parent))
                sock.sendall(request)
                sock.shutdown(socket.SHUT_WR)
                return _read_all(sock) or UNKNOWN
        except OSError:
            return UNKNOWN


def _read_all(sock: socket.socket) -> bytes:
    """The rest of the stream, at most `_MAX_MESSAGE + 1` bytes, within `_ASK_TIMEOUT_S`."""
    deadline = time.monotonic() + _ASK_TIMEOUT_S
    data = b""
    while len(data) <= _MAX_MESSAGE:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the peer did not finish its message in time")
        sock.settimeout(remaining)
        chunk = sock.recv(_MAX_MESSAGE)
        if not chunk:
            break
        data += chunk
    return data[: _MAX_MESSAGE + 1]


def _core_on_stack() -> Any:
    """The engine core among the callers of this thread's current frame."""
    return _core_in_frames(sys._getframe(1))


def _core_in_frames(frame: Any) -> Any:
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return None
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EngineCore):
            return candidate
        frame = frame.f_back
    return None


def _data_parallel(core: Any) -> bool:
    return getattr(core, "dp_group", None) is not None


def _resume(core: Any) -> None:
    """Clear the scheduler's pause state as vLLM's own resume does for one engine
    core (the busy loop reads it each step), then wake the loop in case it waits."""
    from vllm.v1.core.sched.interface import PauseState

    core.scheduler.set_pause_state(PauseState.UNPAUSED)
    queue = getattr(core, "input_queue", None)
    if queue is not None:
        from vllm.v1.engine import EngineCoreRequestType

        with contextlib.suppress(Exception):
            queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


_votes: weakref.WeakKeyDictionary[Any, dict[int, set[int]]] = weakref.WeakKeyDictionary()
_votes_lock = threading.Lock()


def _vote(core: Any, round_id: int, rank: int, world_size: int) -> None:
    """Worker `rank` asks `core` to resume for round `round_id`; once all `world_size`
    workers did, resume (votes of earlier rounds are dropped)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    with _votes_lock:
        rounds = _votes.setdefault(core, {})
        voters = rounds.setdefault(round_id, set())
        voters.add(rank)
        complete = len(voters) == world_size
        for older in [r for r in rounds if r < round_id or (complete and r == round_id)]:
            del rounds[older]
    if complete:
        _resume(core)


# -- the engine core's side, for workers in processes of their own -------------------
_serving_pid = 0
_serving_lock = threading.Lock()
_found: weakref.ReferenceType[Any] | None = None


def serve_generation() -> None:
    """Listen for this process's worker processes (see the module doc); once per process."""
    global _serving_pid
    with _serving_lock:
        if _serving_pid == os.getpid():
            return
        _serving_pid = os.getpid()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(_ADDRESS.format(pid=os.getpid()))
            sock.listen(16)
        except OSError as e:
            sock.close()
            logger.debug("no generation service in process %d: %s", os.getpid(), e)
            return
    threading.Thread(target=_serve, args=(sock,), name="wt-generation", daemon=True).start()


def _serve(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(_ASK_TIMEOUT_S)
                conn.sendall(_answer(conn))
            except Exception as e:  # one bad caller never stops the service
                logger.debug("generation service: %s", e)


def _answer(conn: socket.socket) -> bytes:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid() or _parent_of(pid) != os.getpid():
        return UNKNOWN
    request = _read_all(conn)
    core = _engine_core()
    if core is None or len(request) > _MAX_MESSAGE:
        return UNKNOWN
    op, argument = request[:1], request[1:]
    if op in (ADAPTER_SERVED, ADAPTER_DROPPED):
        from weight_transfer.vllm import gate

        gate.set_served(core, argument.decode(), op == ADAPTER_SERVED)
        return DONE
    if _data_parallel(core):
        return DATA_PARALLEL if op == QUERY else UNKNOWN
    if op == RESUME:
        _resume(core)
        return DONE
    if op == VOTE:
        round_id, rank, world_size = (int(x) for x in argument.decode().split(":"))
        _vote(core, round_id, rank, world_size)
        return DONE
    if op == LABEL:
        return DONE + str(core.get_weight_version()).encode()
    if op == SET_LABEL:
        core.set_weight_version(argument.decode())
        return DONE
    return PAUSED if core.is_scheduler_paused() else RUNNING


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _engine_core() -> Any:
    """This process's vLLM engine core: its busy loop runs on one of the threads, with
    the engine core as `self` of a frame on that thread's stack (found once)."""
    global _found
    core = _found() if _found is not None else None
    if core is not None:
        return core
    for frame in sys._current_frames().values():
        core = _core_in_frames(frame)
        if core is not None:
            _found = weakref.ref(core)
            return core
    return None
