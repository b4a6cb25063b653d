"""NIXL's progress thread in this process: woken by traffic, not spinning.

Ray's NIXL transport creates one NIXL agent per process, on first use, with
NIXL's defaults. NIXL's Python binding then gives the UCX backend's progress
thread a delay of 0: the thread polls its workers' event descriptors with a
zero timeout, in a loop, for as long as the process lives. Measured here: an
idle process with such an agent used a whole core (3.0 s of CPU in 3 s, half
of it in system calls); every producer actor and every inference worker that
had synced once did, between syncs too, taking a core from the engine beside
it. With a delay of `PROGRESS_POLL_US` the thread sleeps in `poll()` until
its workers have an event, and wakes at that interval otherwise (NIXL's
guard against a missed wakeup): 0.04 s of CPU in 3 s. The thread is still
needed: the side that serves a pull over TCP moves its bytes only when it
progresses (without the thread, pulls stalled).

`poll_not_spin()` (in each process that pulls or serves, before its first
transfer) makes Ray's agent factory build the agent with that delay. It
relies on two internals: Ray's `NixlTensorTransport._make_nixl_agent` and the
binding's `nixlAgentConfig`; where either is missing, it leaves Ray's default
and logs a warning.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["PROGRESS_POLL_US", "poll_not_spin"]

logger = logging.getLogger("wt_sharded_rdt")

PROGRESS_POLL_US = 1000  # the progress thread's idle wakeup interval (NIXL rounds up to 1 ms)

_lock = threading.Lock()


def poll_not_spin() -> bool:
    """Have this process's Ray NIXL agent, when Ray creates it, run its progress thread
    with `PROGRESS_POLL_US`; whether it will (False: the agent exists already, or an
    internal named in the module docstring is missing)."""
    try:
        from ray.experimental.rdt.util import get_tensor_transport_manager

        manager: Any = get_tensor_transport_manager("NIXL")
        make = manager._make_nixl_agent
        made = manager._nixl_agent is not None
    except (ImportError, AttributeError, ValueError) as error:
        logger.warning("NIXL's progress thread keeps Ray's default, a busy loop (%s)", error)
        return False
    if getattr(make, "polls_not_spins", False):
        return True
    if made:
        logger.warning(
            "NIXL's progress thread keeps Ray's default, a busy loop: this process's agent "
            "was built before wt_sharded_rdt could set its delay"
        )
        return False

    def make_polling_agent(backend: str) -> Any:
        with _agents_poll_every(PROGRESS_POLL_US):
            return make(backend)

    make_polling_agent.polls_not_spins = True  # type: ignore[attr-defined]
    manager._make_nixl_agent = make_polling_agent
    return True


@contextlib.contextmanager
def _agents_poll_every(delay_us: int) -> Iterator[None]:
    """While held, agents that NIXL's `nixl_agent` builds get a progress delay of at least
    `delay_us` (its constructor sets 0 on the binding's config; the subclass raises it)."""
    from nixl._api import nixl_agent

    api: Any = sys.modules[nixl_agent.__module__]
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        pthrDelay = property(
            lambda self: base.pthrDelay.__get__(self),
            lambda self, value: base.pthrDelay.__set__(self, max(int(value), delay_us)),
        )

    names = {k: getattr(bindings, k) for k in dir(bindings) if not k.startswith("__")}
    with _lock:
        api.nixlBind = types.SimpleNamespace(**{**names, "nixlAgentConfig": DelayedConfig})
        try:
            yield
        finally:
            api.nixlBind = bindings
