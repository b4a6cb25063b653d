"""What a worker's rounds cost and how they ended: totals since the process started.

Each inference worker process keeps, per backend, cumulative:

- `seconds[phase]` for `PHASES`: `wire` (the backend's receive step, loads it
  overlaps included), `load` (loading into the model and committing),
  `verify` (checking digests), `rollback` (rolling a round back);
- `bytes`: the bytes the round's update infos declared (`nbytes` of an update
  info; full-resync backends declare it);
- `rounds[outcome]` for `OUTCOMES`: `committed` (a round that loaded and
  committed), `rolled_back` (a round that loaded, or a held commit, undone),
  `refused` (a call refused before it changed anything: a bad key, a finish
  before the seal, an init while a round is open). A round abandoned before it
  loaded changed nothing and counts as neither.

`GuardedEngine` records them; `snapshot()` reads this process's; `merged` adds
the snapshots of an engine's workers (seconds and bytes summed, rounds as the
most any worker counted: every worker counts the engine's round once). vLLM's
API server publishes the merged totals on `/metrics` (`weight_transfer.vllm.
metrics`); `engine_metrics(llm)` reads them from an `LLM`.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = [
    "PHASES", "OUTCOMES", "count_seconds", "count_bytes", "count_round", "snapshot", "merged",
]  # fmt: skip

PHASES = ("wire", "load", "verify", "rollback")
OUTCOMES = ("committed", "rolled_back", "refused")

Totals = dict[str, dict[str, Any]]  # backend -> {"seconds": {...}, "bytes": n, "rounds": {...}}

_totals: Totals = {}
_lock = threading.Lock()


def _zero() -> dict[str, Any]:
    return {"seconds": dict.fromkeys(PHASES, 0.0), "bytes": 0, "rounds": dict.fromkeys(OUTCOMES, 0)}


def _of(backend: str) -> dict[str, Any]:
    totals = _totals.get(backend)
    if totals is None:
        totals = _totals[backend] = _zero()
    return totals


def count_seconds(backend: str, phase: str, seconds: float) -> None:
    with _lock:
        _of(backend)["seconds"][phase] += seconds


def count_bytes(backend: str, nbytes: int) -> None:
    with _lock:
        _of(backend)["bytes"] += nbytes


def count_round(backend: str, outcome: str) -> None:
    with _lock:
        _of(backend)["rounds"][outcome] += 1


def snapshot() -> Totals:
    """This process's totals (a copy, JSON-safe)."""
    with _lock:
        return {
            backend: {**t, "seconds": dict(t["seconds"]), "rounds": dict(t["rounds"])}
            for backend, t in _totals.items()
        }


def merged(snapshots: list[Totals]) -> Totals:
    """One engine's totals from its workers' snapshots (see the module doc)."""
    out: Totals = {}
    for totals in snapshots:
        for backend, t in (totals or {}).items():
            into = out.setdefault(backend, _zero())
            for phase, seconds in t["seconds"].items():
                into["seconds"][phase] = into["seconds"].get(phase, 0.0) + seconds
            into["bytes"] += t["bytes"]
            for outcome, count in t["rounds"].items():
                into["rounds"][outcome] = max(into["rounds"].get(outcome, 0), count)
    return out
