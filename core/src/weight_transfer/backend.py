"""The contract a backend distribution builds on, in one place.

A backend is two engines: a trainer engine (its transmit step) and a worker
engine (its receive step). Core owns the rest: the round on both sides, the
transaction around the model, one trainer per engine, re-admission, the
control protocol; `weight_transfer.runtime` keeps all of that, is private to
wt-core, and needs no reading to write a backend. A backend imports from this
module and from the kits (`wt_kits.*`: groups, bucketed
streaming, colocated shared memory, slices, bounded waits), nothing else of
wt-core (`tests/core/test_layers.py` holds every first-party backend to it).

Trainer side
    `TrainerWeightTransferEngine` (the contract's ABC; `open_round` drives a
    round), `ResyncTrainerEngine` (full resync: supply `transmit`),
    `TrainerInitInfo`, `TrainerRound` and `Transfer` (a round's state and its
    workers' futures), `AlignedFailure` (both sides stopped at the same
    point), `VLLMWeightSyncClient`, `fleet_of` (the replicas behind a client),
    `WeightSource` / `ParamMeta` / `Replicate` / `Shard` / `checked_iteration`
    (a source iterated against its own metadata), `layerwise_groups` /
    `layer_key` (parameters by layer), `trainer_device` / `device_name`.

Worker side
    `WeightTransferEngine` (the transaction lives in its base class),
    `WeightTransferInitInfo`, `WeightTransferUpdateInfo`,
    `ParamListUpdateInfo` / `param_list_payload` / `param_list_digests` /
    `PARAM_LIST_FIELDS` (the per-round parameter list), `LayoutMemo` (a
    worker's decoded list and digests, reused while unchanged), `WorkerPosition`,
    `is_vllm_config`, `loader_for` / `DirectLoader` / `Revertible` (the loader
    protocol), `ChannelDownError` (this side has no link to its trainer).

Payloads and limits
    `parse_payload` / `payload_of` (dataclass <-> JSON-safe dict, errors name
    the field), `dtype_name` / `dtype_from_name` / `WIRE_DTYPES`,
    `WireProtocolInfo` (the wire version both ends declare), `check_timeout`,
    `check_int_range`, `check_declared`, `host_memory_bytes` (bounds checked
    before anything is allocated).

Packaging
    `lazy_exports` (a backend package's names, imported on first use).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

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
    WIRE_DTYPES,
    WireProtocolInfo,
    dtype_from_name,
    dtype_name,
    parse_payload,
    payload_of,
)
from weight_transfer.position import WorkerPosition, is_vllm_config
from weight_transfer.resync import (
    PARAM_LIST_FIELDS,
    LayoutMemo,
    ParamListUpdateInfo,
    ResyncTrainerEngine,
    param_list_digests,
    param_list_payload,
)
from weight_transfer.rounds import AlignedFailure, TrainerRound, Transfer
from weight_transfer.runtime.control import ChannelDownError
from weight_transfer.runtime.devices import device_name, trainer_device
from weight_transfer.runtime.direct_loader import DirectLoader
from weight_transfer.runtime.limits import (
    check_declared,
    check_int_range,
    check_timeout,
    host_memory_bytes,
)
from weight_transfer.runtime.round_client import fleet_of
from weight_transfer.source import (
    ParamMeta,
    Replicate,
    Shard,
    WeightSource,
    checked_iteration,
    layer_key,
    layerwise_groups,
)

__all__ = [
    # trainer side
    "TrainerWeightTransferEngine",
    "ResyncTrainerEngine",
    "TrainerInitInfo",
    "TrainerRound",
    "Transfer",
    "AlignedFailure",
    "VLLMWeightSyncClient",
    "fleet_of",
    "WeightSource",
    "ParamMeta",
    "Replicate",
    "Shard",
    "checked_iteration",
    "layerwise_groups",
    "layer_key",
    "trainer_device",
    "device_name",
    # worker side
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "ParamListUpdateInfo",
    "param_list_payload",
    "param_list_digests",
    "PARAM_LIST_FIELDS",
    "LayoutMemo",
    "WorkerPosition",
    "is_vllm_config",
    "loader_for",
    "DirectLoader",
    "Revertible",
    "ChannelDownError",
    # payloads and limits
    "parse_payload",
    "payload_of",
    "dtype_name",
    "dtype_from_name",
    "WIRE_DTYPES",
    "WireProtocolInfo",
    "check_timeout",
    "check_int_range",
    "check_declared",
    "host_memory_bytes",
    # packaging
    "lazy_exports",
]


def lazy_exports(
    homes: Mapping[str, str], aliases: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A package's module `__getattr__` for `homes` (name -> the module defining
    it), imported only when the name is first used, and `aliases` (another
    name -> one of `homes`: vLLM's class names, for ported code)."""
    aliases = dict(aliases or {})

    def __getattr__(name: str) -> Any:
        name = aliases.get(name, name)
        home = homes.get(name)
        if home is None:
            raise AttributeError(name)
        return getattr(importlib.import_module(home), name)

    return __getattr__
