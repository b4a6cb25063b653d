"""Where a round's time goes: seconds per phase of the data plane, when asked.

`with PhaseClock() as clock: engine.send_weights()` adds, while it is open, the
seconds each thread of this process spends in each phase of `PHASES` to
`clock.seconds` (the trainer's and, in process, the workers'):

- `check`: the trainer's finite check (`first_non_finite` over a bucket);
- `pack`: the trainer's copies into a bucket;
- `wire`: the trainer waiting for its sends to be taken (a slot to free, the
  last sends to drain);
- `unpack`: a worker turning a received bucket back into tensors;
- `undo`: a worker's undo record (`ModelSnapshot.take`);
- `load`: a worker loading tensors into the model, and committing the round;
- `verify`: a worker checking a bucket's digests.

Phases on different threads overlap (the load runs while the trainer packs),
so their sum may exceed the round. One clock at a time, process-wide. Apart
from any clock, `total(phase)` is the seconds this process has spent in
`phase` since it started (a worker's round metrics read it:
`weight_transfer.runtime.metrics`); `timed` costs two clock reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["PHASES", "PhaseClock", "timed", "total"]

PHASES = ("check", "pack", "wire", "unpack", "undo", "load", "verify")

_open: PhaseClock | None = None
_totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
_totals_lock = threading.Lock()


class PhaseClock:
    """Seconds per phase while open (a context manager); see the module docstring."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def __enter__(self) -> PhaseClock:
        global _open
        if _open is not None:
            raise RuntimeError("a PhaseClock is already open")
        _open = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _open
        _open = None


def total(phase: str) -> float:
    """Seconds this process has spent in `phase` since it started."""
    return _totals[phase]


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    """Count the enclosed seconds to `phase`: to the process's total, and to the open
    clock, if any."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        with _totals_lock:
            _totals[phase] += seconds
        clock = _open
        if clock is not None:
            clock.add(phase, seconds)
