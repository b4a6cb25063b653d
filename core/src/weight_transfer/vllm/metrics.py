"""wt's round metrics in vLLM: on an API server's `/metrics`, and from an `LLM`.

Every worker keeps its totals (`weight_transfer.runtime.metrics`: seconds per
phase, bytes, rounds by outcome, per backend). The engine core answers the
merged totals of its workers through its utility method `wt_round_metrics`
(`install` adds it). An API server reads them after each weight-transfer call
it answers that may have ended a round (an init, a finish, a shutdown, and any
call that failed; vLLM's routes call `AsyncLLM`'s methods, which `install`
wraps: a start or update that succeeded leaves the workers mid-round, and is
not followed by a read) and publishes them as gauges on vLLM's Prometheus
registry, so its `/metrics` shows them next to vLLM's own
`vllm:rl_weight_update_*` series (with several API servers, in vLLM's
multiprocess mode, each publishes what it read and `/metrics` shows the
highest: the totals only grow):

- `wt:weight_sync_phase_seconds_total{backend, phase}`;
- `wt:weight_sync_bytes_total{backend}`;
- `wt:weight_sync_rounds_total{backend, outcome}`.

A round the watchdog rolls back (its trainer died), and a held commit a fleet
reverts (an update that succeeded), show at the server's next read.
`engine_metrics(llm)` reads the same totals from an `LLM` (or, through
`collective_rpc`, a Ray actor's engine: `merged` of
`collective_rpc(worker_metrics)`). `backend` is the worker engine's class.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Any

from weight_transfer.runtime.metrics import OUTCOMES, PHASES, Totals, merged, snapshot

__all__ = [
    "install", "engine_metrics", "worker_metrics", "read_totals", "publish", "calls_in_flight",
    "ENGINE_CORE_METRICS",
]  # fmt: skip

logger = logging.getLogger("weight_transfer")

ENGINE_CORE_METRICS = "wt_round_metrics"  # the engine core's utility method
READ_TIMEOUT_S = 30.0
# AsyncLLM's weight-transfer methods, after which an API server publishes the totals.
PUBLISHED_AFTER = (
    "init_weight_transfer_engine",
    "shutdown_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)
# Calls after which a round is still open: their success changes no total worth a read
# (the workers are mid-round; the round's end is read after its finish).
MID_ROUND = ("start_weight_update", "update_weights")
_MARK = "__wt_metrics__"
_calls_in_flight = 0
latest: Totals = {}  # the totals this process read last


def worker_metrics(worker: Any = None) -> Totals:
    """This worker's totals (run in each worker through `collective_rpc`)."""
    return snapshot()


def engine_metrics(llm: Any) -> Totals:
    """The merged totals of an `LLM`'s workers."""
    return merged(llm.collective_rpc(worker_metrics))


def install() -> None:
    """The engine core's utility method and the API server's publishing (once)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, ENGINE_CORE_METRICS, None) is not None:
        return
    setattr(EngineCore, ENGINE_CORE_METRICS, _engine_core_metrics)
    for name in PUBLISHED_AFTER:
        original = getattr(AsyncLLM, name, None)
        if original is not None:
            wrapper = functools.wraps(original)(_publishing(original, name))
            setattr(wrapper, _MARK, True)
            setattr(AsyncLLM, name, wrapper)


def _engine_core_metrics(self: Any) -> Totals:
    return merged(self.collective_rpc(worker_metrics))


def _publishing(original: Any, name: str) -> Any:
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _calls_in_flight
        ended = name not in MID_ROUND
        _calls_in_flight += 1
        try:
            return await original(self, *args, **kwargs)
        except BaseException:
            ended = True  # a failed call may have ended the round
            raise
        finally:
            _calls_in_flight -= 1
            if ended:
                await _read_and_publish(self)

    return call


def calls_in_flight() -> int:
    """The weight-transfer calls this API server is answering now."""
    return _calls_in_flight


async def read_totals(engine: Any, timeout_s: float = READ_TIMEOUT_S) -> Totals:
    """The merged totals of an `AsyncLLM`'s workers, read through its engine core
    (raises `TimeoutError` after `timeout_s`: the engine core answers between steps)."""
    return await asyncio.wait_for(
        engine.engine_core.call_utility_async(ENGINE_CORE_METRICS), timeout_s
    )


async def _read_and_publish(engine: Any) -> None:
    try:
        totals = await read_totals(engine)
    except Exception as e:  # metrics never fail a weight-transfer call
        logger.debug("wt round metrics not read: %s", e)
        return
    global latest
    latest = totals
    publish(totals)


class _Gauges:
    def __init__(self) -> None:
        from prometheus_client import Gauge

        def gauge(name: str, doc: str, labels: list[str]) -> Any:
            return Gauge(name, doc, labels, multiprocess_mode="max")

        self.seconds = gauge(
            "wt:weight_sync_phase_seconds_total",
            "Seconds the engine's workers spent in each phase of wt's weight syncs.",
            ["backend", "phase"],
        )
        self.bytes = gauge(
            "wt:weight_sync_bytes_total",
            "Bytes of parameters wt's weight syncs moved into the engine.",
            ["backend"],
        )
        self.rounds = gauge(
            "wt:weight_sync_rounds_total",
            "wt weight-sync rounds by outcome (committed, rolled_back, refused).",
            ["backend", "outcome"],
        )


_gauges: _Gauges | None = None
_gauges_lock = threading.Lock()


def publish(totals: Totals) -> None:
    """Set this process's gauges to `totals` (created on first use, after vLLM's
    multiprocess Prometheus set-up)."""
    global _gauges
    with _gauges_lock:
        if _gauges is None:
            _gauges = _Gauges()
        gauges = _gauges
    for backend, t in totals.items():
        for phase in PHASES:
            gauges.seconds.labels(backend, phase).set(t["seconds"].get(phase, 0.0))
        gauges.bytes.labels(backend).set(t["bytes"])
        for outcome in OUTCOMES:
            gauges.rounds.labels(backend, outcome).set(t["rounds"].get(outcome, 0))
