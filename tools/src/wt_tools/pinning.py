"""Which cores the trainer and the engines run on, set while the bench runs.

In a deployment the trainer computes on devices of its own; on one CPU host
the bench gets that by pinning: `Pinning.disjoint()` puts this process (the
trainer) and every process it started but the engines' (Ray's, say) on the
first half of the cores it may use, the engines' processes on the other half,
with torch's thread counts to match; `Pinning.shared()` puts everything back
on every core with the thread counts found at the start. Every thread of a
process is pinned (`/proc/<pid>/task`); threads started later inherit their
creator's cores. Linux only (`/proc`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["Cores", "Pinning", "descendants", "engine_processes"]

Cores = Literal["shared", "disjoint"]


def engine_processes(start: Callable[[], Any]) -> tuple[Any, set[int]]:
    """Run `start()` (which starts an engine); its result and the PIDs of the processes
    it started (this process's new descendants)."""
    before = descendants(os.getpid())
    made = start()
    return made, descendants(os.getpid()) - before


def descendants(pid: int) -> set[int]:
    """The PIDs of `pid`'s children, their children, and so on (read from `/proc`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # it has ended
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "(comm) state"
            children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass
class Pinning:
    """The engines' processes (`engine_pids`) and how to set their torch thread count
    (`set_engine_threads(n)`); `cores` is what is in force."""

    engine_pids: set[int]
    set_engine_threads: Callable[[int], None]
    engine_threads: int
    trainer_threads: int = field(default_factory=torch.get_num_threads)
    cpus: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))
    cores: Cores = "shared"

    @property
    def can_split(self) -> bool:
        return len(self.cpus) >= 2

    def apply(self, cores: Cores) -> None:
        if cores == self.cores:
            return
        if cores == "disjoint":
            self.disjoint()
        else:
            self.shared()

    def disjoint(self) -> None:
        if not self.can_split:
            raise RuntimeError(f"disjoint cores need at least 2 CPUs, this process has {self.cpus}")
        half = len(self.cpus) // 2
        trainer, engine = set(self.cpus[:half]), set(self.cpus[half:])
        self._pin(trainer, engine)
        torch.set_num_threads(len(trainer))
        self.set_engine_threads(len(engine))
        self.cores = "disjoint"

    def shared(self) -> None:
        every = set(self.cpus)
        self._pin(every, every)
        torch.set_num_threads(self.trainer_threads)
        self.set_engine_threads(self.engine_threads)
        self.cores = "shared"

    def _pin(self, trainer: set[int], engine: set[int]) -> None:
        engines = set(self.engine_pids)
        for pid in self.engine_pids:
            engines |= descendants(pid)
        for pid in [os.getpid(), *descendants(os.getpid())]:
            _pin_threads(pid, engine if pid in engines else trainer)


def _pin_threads(pid: int, cpus: Iterable[int]) -> None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return  # the process has ended
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that has ended
            os.sched_setaffinity(int(tid), set(cpus))
