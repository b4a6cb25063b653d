"""Bounded waits for a transmit or receive step: every wait a backend makes ends
within its timeout and raises naming what it waited for.

`in_background(fn, name=)` runs a call on a daemon thread (a `Future`);
`work_future(work, what)` makes a `torch.distributed` collective's `Work` a
`Future` that polls it, so a transmit step can watch the workers' call while
it waits; `wait_for(futures, timeout_s)` waits for several, the first failure
raised at once; `all_settle(futures, within_s)` lets calls of a failed round
end; `PEER_GRACE_S` is the time a peer gets to say why it failed.
"""

from weight_transfer.runtime.waiting import (
    PEER_GRACE_S,
    all_settle,
    in_background,
    wait_for,
    work_future,
)

__all__ = ["PEER_GRACE_S", "all_settle", "in_background", "wait_for", "work_future"]
