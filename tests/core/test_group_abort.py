"""Aborting a `StatelessGroup` never stalls its process, and a failed rendezvous ends at once.

gloo cannot cancel a collective in flight, and destroying its process group
waits for each of them to end (up to the group's timeout) while holding the
interpreter lock: before, a worker that dropped a group whose trainer had died
froze its whole process (vLLM's engine core with it) for `timeout_s`.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import torch

from wt_kits.group.auth import new_secret
from wt_kits.group.stateless import StatelessGroup, free_port

TIMEOUT_S = 20.0


def _pair() -> tuple[StatelessGroup, StatelessGroup]:
    port, secret = free_port(), new_secret()
    groups: dict[int, StatelessGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = StatelessGroup.create(
            host="127.0.0.1", port=port, rank=rank, world_size=2, secret=secret,
            timeout_s=TIMEOUT_S,
        )  # fmt: skip

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups[0], groups[1]


def test_dropping_an_aborted_group_with_a_receive_in_flight_does_not_stall() -> None:
    trainer, worker = _pair()
    work = worker.broadcast(torch.empty(16))  # the trainer never sends it
    ticking = []
    ticker = threading.Thread(  # the rest of the process must keep running meanwhile
        target=lambda: [ticking.append(time.sleep(0.05)) for _ in range(20)], daemon=True
    )
    ticker.start()
    t0 = time.monotonic()
    worker.abort()
    del work, worker
    gc.collect()
    elapsed = time.monotonic() - t0
    ticker.join(5)
    # a stall lasts the receive's timeout; well under it, the drop did not wait for it (on two
    # busy cores the abort itself took 2.5 s once)
    assert elapsed < TIMEOUT_S / 4, (
        f"dropping the aborted group took {elapsed:.1f}s (timeout {TIMEOUT_S}s)"
    )
    assert len(ticking) == 20
    trainer.close()


EXITING_WORKER = textwrap.dedent(
    """
    import sys, threading, time, torch
    from wt_kits.group.stateless import StatelessGroup
    port, secret = int(sys.argv[1]), sys.argv[2]
    group = StatelessGroup.create(host="127.0.0.1", port=port, rank=1, world_size=2,
                                  secret=secret, timeout_s=20.0)
    work = group.broadcast(torch.empty(16))
    group.abort()
    print("ABORTED", flush=True)
    """
)


def test_a_process_exits_at_once_with_an_aborted_group_still_in_flight() -> None:
    """Exiting runs no destructor of a buried group (a collective ending during the
    interpreter's exit would abort the process), so it neither waits nor crashes."""
    port, secret = free_port(), new_secret()
    proc = subprocess.Popen(
        [sys.executable, "-c", EXITING_WORKER, str(port), secret],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trainer = StatelessGroup.create(
        host="127.0.0.1", port=port, rank=0, world_size=2, secret=secret, timeout_s=TIMEOUT_S
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ABORTED", line
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 0, out
        assert elapsed < 5.0, f"the process took {elapsed:.1f}s to exit after the abort"
    finally:
        if proc.poll() is None:
            proc.kill()
        trainer.close()
