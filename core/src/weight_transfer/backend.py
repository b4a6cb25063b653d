"""The contract a backend distribution builds on, in one place (25 names).

A backend is two engines: a trainer engine (its transmit step) and a worker
engine (its receive step). Core owns the rest: the round on both sides, the
transaction around the model, one trainer per engine, re-admission, the
control protocol; `weight_transfer.runtime` keeps all of that and needs no
reading to write a backend. The names below come from the seven contract
modules (`base`, `source`, `rounds`, `resync`, `loading`, `payload`,
`position`). Optional helpers (groups, bucketed streaming, colocated shared
memory, slices) are kits: `weight_transfer.kits.*`; a few small runtime
helpers may be used too (`runtime.waiting`, `runtime.limits`).

Trainer side
    `TrainerWeightTransferEngine` (the spec's ABC; `open_round` drives a
    round), `ResyncTrainerEngine` (full resync: supply `transmit`),
    `TrainerInitInfo`, `TrainerRound` and `Transfer` (a round's state and its
    workers' futures), `AlignedFailure` (both sides stopped at the same
    point), `VLLMWeightSyncClient`, `WeightSource` / `ParamMeta` /
    `checked_iteration` (a source iterated against its own metadata).

Worker side
    `WeightTransferEngine` (the transaction lives in its base class),
    `WeightTransferInitInfo`, `WeightTransferUpdateInfo`,
    `ParamListUpdateInfo` / `param_list_payload` (the per-round parameter
    list), `WorkerPosition`, `loader_for` / `DirectLoader` / `Revertible`
    (the loader protocol).

Payloads
    `parse_payload` / `payload_of` (dataclass <-> JSON-safe dict, errors name
    the field), `dtype_name` / `dtype_from_name`, `WireProtocolInfo` (the
    wire version both ends declare), `check_timeout`.
"""

from __future__ import annotations

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weight_transfer.loading import Revertible, loader_for
from weight_transfer.payload import (
    WireProtocolInfo,
    dtype_from_name,
    dtype_name,
    parse_payload,
    payload_of,
)
from weight_transfer.position import WorkerPosition
from weight_transfer.resync import ParamListUpdateInfo, ResyncTrainerEngine, param_list_payload
from weight_transfer.rounds import AlignedFailure, TrainerRound, Transfer
from weight_transfer.runtime.direct_loader import DirectLoader
from weight_transfer.runtime.limits import check_timeout
from weight_transfer.source import ParamMeta, WeightSource, checked_iteration

__all__ = [
    # trainer side
    "TrainerWeightTransferEngine",
    "ResyncTrainerEngine",
    "TrainerInitInfo",
    "TrainerRound",
    "Transfer",
    "AlignedFailure",
    "VLLMWeightSyncClient",
    "WeightSource",
    "ParamMeta",
    "checked_iteration",
    # worker side
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "ParamListUpdateInfo",
    "param_list_payload",
    "WorkerPosition",
    "loader_for",
    "DirectLoader",
    "Revertible",
    # payloads
    "parse_payload",
    "payload_of",
    "dtype_name",
    "dtype_from_name",
    "WireProtocolInfo",
    "check_timeout",
]
