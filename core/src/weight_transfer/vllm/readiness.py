"""Hold an API server out of traffic until its engine has the trainer's weights.

A fresh or restarted replica loads its checkpoint, which is not what the
trainer has trained since. Started with

    vllm serve ... --middleware weight_transfer.vllm.readiness.hold_until_first_sync

an API server answers, until its engine has committed a wt round (any
backend; `weight_transfer.runtime.metrics` counts them):

- its health routes (`HEALTH`: `/health`, `/ping`) with 503, so a load
  balancer or Kubernetes readiness probe holds it out of rotation;
- its generation routes (`GENERATION`: completions, chat, responses, ...)
  with 503 and an OpenAI-style error naming why, so a caller that reaches it
  anyway is refused, never served the checkpoint's weights.

Every other route (the weight-transfer routes, `/metrics`, `/v1/models`,
`/weight_info`, pause and resume) is served, so a trainer (a fleet re-admitting
the replica: `FanOutClient` re-forms its group at the next `send_weights`)
can deliver the first round. The first committed round makes the server
ready for good; a round that fails or rolls back leaves it held. (A fleet's
held commit that is reverted after its finish leaves the engine on its
checkpoint, but counted committed: the server is ready.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from weight_transfer.vllm import metrics

__all__ = ["hold_until_first_sync", "HEALTH", "GENERATION", "NOT_READY"]

logger = logging.getLogger("weight_transfer.vllm")

HEALTH = ("/health", "/ping")
GENERATION = (
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/embeddings", "/v1/audio", "/v1/realtime", "/v1/score", "/v1/rerank", "/v2/rerank",
    "/score", "/rerank", "/classify", "/pooling", "/inference", "/generate", "/invocations",
)  # fmt: skip
NOT_READY = (
    "not ready: this engine has not yet received the trainer's weights "
    "(held until its first wt weight sync commits)"
)
READ_TIMEOUT_S = 5.0  # the engine core answers between steps; a round in flight delays it
REREAD_AFTER_S = 1.0  # while held, the engine's totals are read at most this often

_ready = False
_reading: asyncio.Future[bool] | None = None
_read_at = -REREAD_AFTER_S  # when the last read began (monotonic)


async def hold_until_first_sync(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """vLLM `--middleware` (an HTTP middleware function): see the module doc."""
    if _ready or not _held(request.url.path) or await _has_committed(request.app):
        return await call_next(request)
    from starlette.responses import JSONResponse

    error = {"message": NOT_READY, "type": "ServiceUnavailable", "param": None, "code": 503}
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})


def _held(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in (*HEALTH, *GENERATION))


async def _has_committed(app: Any) -> bool:
    """Whether the engine has committed a round: from the totals this process read
    after its last weight-transfer call, else (none in flight here) read now: one
    read at a time, shared by the requests waiting on it, at most one a second."""
    global _reading, _read_at
    if _committed(metrics.latest):
        return _mark_ready()
    if metrics.calls_in_flight():
        return False  # a round's call is running: its end is read when it returns
    if _reading is None:
        if time.monotonic() - _read_at < REREAD_AFTER_S:
            return False
        _read_at = time.monotonic()
        _reading = asyncio.ensure_future(_read_committed(app.state.engine_client))
    reading = _reading
    try:
        return await asyncio.shield(reading)
    finally:
        if _reading is reading and reading.done():
            _reading = None


async def _read_committed(engine: Any) -> bool:
    try:
        totals = await metrics.read_totals(engine, READ_TIMEOUT_S)
    except Exception as e:  # not known to be ready: stay held
        logger.debug("readiness not read: %s", e)
        return False
    return _mark_ready() if _committed(totals) else False


def _committed(totals: metrics.Totals) -> bool:
    return any(t["rounds"].get("committed", 0) > 0 for t in totals.values())


def _mark_ready() -> bool:
    global _ready
    if not _ready:
        logger.info("the engine has the trainer's weights: serving traffic")
    _ready = True
    return True
