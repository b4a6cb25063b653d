"""Which requests on wt's LoRA adapters an engine core admits (engine-core side).

A request reaches a wt adapter through its `lora_path`, `wt-adapter:<name>`
(`weight_transfer.vllm.adapters`): under that name, or under any other name a
caller registered for the path. The worker loads a request's adapter inside
an engine step, where a failure kills the engine core. So the engine core
admits a request on a wt path only while its workers serve that adapter, and
fails any other such request alone, before any step runs it:

- each worker's `AdapterStore` tells its engine core when it starts or stops
  serving an adapter (`set_served`, through `serving.Generation`; an engine
  core serves none until told);
- a request added while its adapter is not served is refused: in a server's
  engine core it finishes at once with vLLM's request-level error (HTTP 500
  for that request); in an in-process `LLM` its `generate` raises
  `ValueError` before anything is queued (`refusal`, checked by the wrappers
  in `weight_transfer.vllm.patches`);
- when an adapter stops being served, the requests of a server's engine core
  that name it and have not finished (queued behind a pause, say) finish
  with that error at once.

A request whose own name is a synced adapter's is served from the store
whatever its path says (`AdapterStore.served_name`), so it is admitted.
Version-pinned to vLLM 0.32's engine core, which 0.33.0 keeps (`scheduler.requests`,
`scheduler.finish_requests`, `EngineCoreProc._send_error_outputs_to_client`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from weight_transfer.runtime.adapters import ADAPTER_SCHEME

__all__ = ["refusal", "set_served", "served"]

logger = logging.getLogger("weight_transfer")

_served: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def served(core: Any) -> frozenset[str]:
    """The wt adapters `core`'s workers serve (none until a worker says so)."""
    with _lock:
        return _served.get(core, frozenset())


def refusal(core: Any, lora_request: Any) -> str | None:
    """Why `core` must not run a request on `lora_request`, or None to admit it."""
    path = getattr(lora_request, "lora_path", None)
    if not isinstance(path, str) or not path.startswith(ADAPTER_SCHEME):
        return None
    names = served(core)
    target = path[len(ADAPTER_SCHEME) :]
    name = getattr(lora_request, "lora_name", None)
    if target in names or name in names:
        return None
    return (
        f"LoRA adapter {name!r} names the wt adapter {target!r}, which this engine does "
        "not serve (never synced since the engine started, or removed)"
    )


def set_served(core: Any, name: str, serving: bool) -> None:
    """Record whether `core`'s workers serve adapter `name`; a server's requests on an
    adapter no longer served finish with an error at once (see the module doc)."""
    with _lock:
        names = set(_served.get(core, frozenset()))
        if serving:
            names.add(name)
        else:
            names.discard(name)
        _served[core] = frozenset(names)
    if not serving:
        _fail_waiting(core)


def _fail_waiting(core: Any) -> None:
    """Finish, with vLLM's request-level error, the unfinished requests of `core` that it
    no longer admits. Only a server's engine core (`EngineCoreProc`) sends outputs of
    its own; an in-process `LLM` runs no request while its caller removes an adapter."""
    send = getattr(core, "_send_error_outputs_to_client", None)
    scheduler = getattr(core, "scheduler", None)
    if send is None or scheduler is None:
        return
    from vllm.v1.request import RequestStatus

    doomed: dict[int, list[str]] = {}
    for request in list(scheduler.requests.values()):
        if not request.is_finished() and refusal(core, request.lora_request) is not None:
            doomed.setdefault(request.client_index, []).append(request.request_id)
    for client_index, request_ids in doomed.items():
        logger.warning(
            "failing %d request(s) on a removed LoRA adapter: %s", len(request_ids), request_ids
        )
        scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        send(request_ids, client_index)
