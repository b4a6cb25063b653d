"""An aborted group with a collective in flight never freezes its process.

gloo's process-group destructor waits for the collectives still in flight
while holding the interpreter lock; `StatelessGroup.abort` keeps the group
alive until they have timed out, so a garbage collection meanwhile is quick
and other threads keep running.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time

import torch

from weight_transfer.backend import StatelessGroup, free_port
from weight_transfer.transport.auth import new_secret
from weight_transfer.transport.futures import in_background

TIMEOUT_S = 20.0


def test_collecting_an_aborted_group_with_a_send_in_flight_does_not_stall() -> None:
    port, secret = free_port(), new_secret()
    joining = [
        in_background(
            lambda r=r: StatelessGroup.create(
                host="127.0.0.1", port=port, rank=r, world_size=2, secret=secret,
                trainer_id="t", timeout_s=TIMEOUT_S,
            ),
            name=f"join-{r}",
        )
        for r in (0, 1)
    ]  # fmt: skip
    trainer, worker = (j.result(30) for j in joining)
    trainer.broadcast(torch.ones(1 << 20))  # the worker never receives it
    time.sleep(0.5)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.05):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        t0 = time.monotonic()
        trainer.abort()  # the worker's end stays open, as a replica's does
        del trainer, joining
        gc.collect()
        elapsed = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        stop.set()
        ticker.join(5)
        worker.abort()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert elapsed < 5.0, f"abort and collection took {elapsed:.1f}s"
    assert max(gaps, default=0.0) < 2.0, f"the process froze for {max(gaps):.1f}s"
