"""The worker pool's client (`weight_transfer.testing.workers.FanoutClient`): a call
that raised on one worker has ended on every other before the next call reaches it."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection, Listener

import pytest

from weight_transfer.clients import WeightSyncRPCError
from weight_transfer.testing.workers import AUTHKEY, FanoutClient


class Worker:
    """A worker speaking the pool's protocol that runs each connection's calls on a
    thread of its own, as the pool's workers do, and logs when each call runs."""

    def __init__(self, slow_s: float, fails: bool) -> None:
        self.slow_s, self.fails = slow_s, fails
        self.log: list[str] = []
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    method, _, _ = conn.recv()
                except (EOFError, OSError):
                    return
                self.log.append(f"{method} begins")
                if method == "abort" and self.fails:
                    conn.send(("err", "RuntimeError: no round is open", ""))
                    continue
                time.sleep(self.slow_s if method == "abort" else 0.0)
                self.log.append(f"{method} ends")
                conn.send(("ok", None))


def test_a_call_waits_for_the_answers_the_call_before_it_left_owed() -> None:
    slow, refusing = Worker(slow_s=0.5, fails=False), Worker(slow_s=0.0, fails=True)
    client = FanoutClient([slow.listener.address, refusing.listener.address], timeout_s=10.0)
    try:
        with pytest.raises(WeightSyncRPCError, match="worker 1: RuntimeError: no round"):
            client.call("abort")  # worker 1 refuses at once; worker 0 still runs it
        client.call("start")
        assert slow.log == ["abort begins", "abort ends", "start begins", "start ends"]
    finally:
        slow.listener.close()
        refusing.listener.close()
