"""What wt changes in vLLM's own objects: installed once per process by the plugin.

Two guarantees need a hand in vLLM's own entry points, since nothing a caller
posts reaches a worker with the information needed:

- **The label is the trainer's.** vLLM's `finish_weight_update(weight_version)`
  finishes the workers' round, then sets the label in the front end; the
  workers never see the label. `LLM.finish_weight_update` and
  `AsyncLLM.finish_weight_update` (the HTTP route's) are wrapped to finish
  through the engine core's `wt_finish_weight_update(weight_version)` instead,
  which hands each worker the label with its finish (`finish_labeled`). A wt
  engine serving a keyed trainer then commits a sealed round only under the
  label the trainer sealed (`WeightTransferEngine`: a finish with another
  label is refused, and the round stays open for the trainer's own finish); a
  finish with the label of the round it just committed, after another caller's
  finish committed it, succeeds without touching anything.
- **Requests on wt adapters fail alone.** `EngineCore.add_request` and, for an
  in-process `LLM`, `LLMEngine.add_request` admit a request on a wt adapter
  path only while the workers serve that adapter (`weight_transfer.vllm.gate`).
- **A refused call leaves an engine of several workers usable.** A refusal is how
  a worker ends vLLM's round (an in-band abort, an update refused); vLLM 0.32's
  `MultiprocExecutor.collective_rpc` stops reading replies at the first failed
  worker, so the next call read the others' stale replies (vLLM issue #49972)
  and every later call failed. `MultiprocExecutor.collective_rpc` is wrapped
  to read each worker's reply of a failed blocking call (`_aligned_replies`).

Version-pinned to vLLM 0.32's entry points, which 0.33.0 keeps
(`AsyncLLM.finish_weight_update`, `RLOfflineMixin.finish_weight_update`,
`EngineCore.add_request` / `collective_rpc`, `LLMEngine.add_request`,
`Worker._weight_update_active`, `MultiprocExecutor.response_mqs` / `futures_queue`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

DRAIN_TIMEOUT_S = 300.0  # the most a failed call waits for the other workers' replies

__all__ = ["install", "finish_labeled", "ENGINE_CORE_FINISH"]

logger = logging.getLogger("weight_transfer")

ENGINE_CORE_FINISH = "wt_finish_weight_update"  # the engine core's utility method
_MARK = "__wt_patched__"


def install() -> None:
    """Install every wrapper below into vLLM's classes (once; later calls do nothing)."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if getattr(EngineCore, ENGINE_CORE_FINISH, None) is not None:
        return
    setattr(EngineCore, ENGINE_CORE_FINISH, _engine_core_finish)
    _wrap(EngineCore, "add_request", _admitting_core)
    _wrap(LLMEngine, "add_request", _admitting_llm_engine)
    _wrap(RLOfflineMixin, "finish_weight_update", _finishing_llm)
    _wrap(AsyncLLM, "finish_weight_update", _finishing_async_llm)
    _wrap(MultiprocExecutor, "collective_rpc", _aligned_replies)


def _wrap(cls: type, name: str, make: Any) -> None:
    original = getattr(cls, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


# -- the label: finish through the engine core, the label handed to each worker --------
def finish_labeled(worker: Any, weight_version: str | None) -> None:
    """In each worker (through `collective_rpc`): vLLM's `finish_weight_update`, with
    the label a wt engine checks against the trainer's seal."""
    engine = getattr(worker, "weight_transfer_engine", None)
    labeled = getattr(engine, "finishing_as", None)
    if not callable(labeled):
        worker.finish_weight_update()
        return
    with labeled(weight_version) as committed_as_labeled:
        if committed_as_labeled and not getattr(worker, "_weight_update_active", True):
            return  # another caller's finish committed the trainer's round, under this label
        worker.finish_weight_update()


def _engine_core_finish(self: Any, weight_version: str | None = None) -> None:
    self.collective_rpc(finish_labeled, args=(weight_version,))


def _finishing_llm(original: Any) -> Any:
    def finish_weight_update(self: Any, weight_version: str | None = None) -> None:
        client = self.llm_engine.engine_core
        core = getattr(client, "engine_core", None)  # an in-process engine core
        if core is not None:
            getattr(core, ENGINE_CORE_FINISH)(weight_version)
        else:
            client.call_utility(ENGINE_CORE_FINISH, weight_version)
        if weight_version is not None:
            self.llm_engine.set_weight_version(weight_version)

    return finish_weight_update


def _finishing_async_llm(original: Any) -> Any:
    async def finish_weight_update(self: Any, weight_version: str | None = None) -> None:
        await self.engine_core.call_utility_async(ENGINE_CORE_FINISH, weight_version)
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    return finish_weight_update


# -- the adapter gate ------------------------------------------------------------------
def _admitting_core(original: Any) -> Any:
    def add_request(self: Any, request: Any, request_wave: int = 0) -> None:
        from weight_transfer.vllm.gate import refusal

        why = refusal(self, request.lora_request)
        if why is None:
            return original(self, request, request_wave)
        send = getattr(self, "_send_error_outputs_to_client", None)
        if send is None:  # an in-process engine core: the caller's call raises
            raise ValueError(why)
        logger.warning("request %s refused: %s", request.request_id, why)
        send([request.request_id], request.client_index)

    return add_request


def _admitting_llm_engine(original: Any) -> Any:
    def add_request(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        core = getattr(self.engine_core, "engine_core", None)  # an in-process engine core
        lora = kwargs.get("lora_request")
        if core is not None and lora is not None:
            from weight_transfer.vllm.gate import refusal

            why = refusal(core, lora)
            if why is not None:  # before the request is queued anywhere
                raise ValueError(why)
        return original(self, request_id, *args, **kwargs)

    return add_request


# -- replies of a failed call, read -------------------------------------------------------
class _CountedQueue:
    """A worker's reply queue (vLLM's `MessageQueue`) that counts the replies read."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.reads = 0

    def dequeue(self, *args: Any, **kwargs: Any) -> Any:
        reply = self.queue.dequeue(*args, **kwargs)
        self.reads += 1
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def _aligned_replies(original: Any) -> Any:
    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        **aggregators: Any,
    ) -> Any:
        call = (method, timeout, args, kwargs, non_block, unique_reply_rank)
        queues = getattr(self, "response_mqs", None) or []
        if non_block or len(queues) < 2 or getattr(self, "futures_queue", None):
            return original(self, *call, **aggregators)  # replies of other calls are pending
        if not all(isinstance(q, _CountedQueue) for q in queues):
            queues = self.response_mqs = [
                q if isinstance(q, _CountedQueue) else _CountedQueue(q) for q in queues
            ]
        before = [q.reads for q in queues]
        try:
            return original(self, *call, **aggregators)
        except RuntimeError:
            replying = range(len(queues))
            if unique_reply_rank is not None and not any(aggregators.values()):
                replying = range(unique_reply_rank, unique_reply_rank + 1)
            for rank in replying:
                if queues[rank].reads == before[rank]:
                    _read_reply(queues[rank], rank, method, timeout)
            raise

    return collective_rpc


def _read_reply(queue: _CountedQueue, rank: int, method: Any, timeout: float | None) -> None:
    """Read and drop worker `rank`'s reply to a call another worker failed."""
    try:
        queue.dequeue(timeout=timeout or DRAIN_TIMEOUT_S)
    except TimeoutError:
        logger.error(
            "worker %d did not reply to the failed call %r in time: its next reply is stale",
            rank, method,
        )  # fmt: skip
