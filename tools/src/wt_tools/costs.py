"""One warm round's costs, counted (no timing): what a GPU pays, read on any device.

`count_round(send, client, workers)` runs `send()` (one sync) and returns,
for the process that calls it:

- `control_calls`: the calls `client` (a `wt_tools.counting.CountedClient`
  wrapping the trainer's client) made, by method;
- `wire_messages`: the messages this process put on a wt wire
  (`WireCalls`: group broadcasts, local-link frames);
- `host_reads`: the host reads on every thread (`HostSyncs`);
- `aten_ops`, `copied_bytes`, `allocations`: on the calling thread (`AtenOps`);

and, given `workers` (`wt_tools.workers.WorkerProcesses`), the first
worker's side: `worker_wire_messages`, `worker_host_reads` and
`worker_unpack`.

`worker_counters()` gives a worker process the two services that count its
side of a round: `count_costs()` starts counting (host reads and wire
messages on every thread, and `AtenOps` around its unpacking, on the thread
that receives), `costs()` stops and returns `{"host_syncs": {...}, "wire":
{...}, "unpack": {"copied_bytes", "allocations", "ops", "buckets"}}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wt_tools.counting import AtenOps, CountedClient, HostSyncs, WireCalls

__all__ = ["count_round", "worker_counters"]


def count_round(
    send: Callable[[], Any], client: CountedClient, workers: Any = None
) -> dict[str, Any]:
    """The counts of one `send()` here and in the first of `workers` (module docstring)."""
    client.counts.clear()
    if workers is not None:
        workers.call("count_costs")
    with HostSyncs() as syncs, WireCalls() as wire, AtenOps() as ops:
        send()
    counts: dict[str, Any] = {
        "control_calls": dict(client.counts),
        "wire_messages": wire.total,
        "host_reads": syncs.total,
        "aten_ops": ops.total,
        "copied_bytes": ops.copied_bytes,
        "allocations": sum(ops.allocations.values()),
    }
    if workers is not None:
        worker = workers.call("costs")[0]
        counts["worker_wire_messages"] = sum(worker["wire"].values())
        counts["worker_host_reads"] = sum(worker["host_syncs"].values())
        counts["worker_unpack"] = worker["unpack"]
    return counts


def worker_counters() -> dict[str, Callable[..., Any]]:
    """`{"count_costs": ..., "costs": ...}`: a worker's side of a round (module docstring)."""
    from wt_kits.stream import Unpacker

    counters: list[tuple[HostSyncs, WireCalls, AtenOps, Any]] = []
    unpacked: list[int] = []

    def count_costs() -> None:
        ops, unpack = AtenOps(), Unpacker.unpack
        unpacked.clear()

        def counted_unpack(self: Unpacker, k: int, *args: Any, **kwargs: Any) -> Any:
            unpacked.append(k)
            with ops:
                return unpack(self, k, *args, **kwargs)

        Unpacker.unpack = counted_unpack  # type: ignore[method-assign]
        counters.append((HostSyncs().start(), WireCalls().start(), ops, unpack))

    def costs() -> dict[str, dict[str, int]]:
        syncs, wire, ops, unpack = counters.pop()
        Unpacker.unpack = unpack  # type: ignore[method-assign]
        return {
            "host_syncs": dict(syncs.stop().counts),
            "wire": dict(wire.stop().counts),
            "unpack": {
                "copied_bytes": ops.copied_bytes,
                "allocations": sum(ops.allocations.values()),
                "ops": ops.total,
                "buckets": len(unpacked),
            },
        }

    return {"count_costs": count_costs, "costs": costs}
