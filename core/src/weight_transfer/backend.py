"""Everything a backend distribution imports from wt-core, in one place.

A backend is two engines: a trainer engine (its transmit step) and a worker
engine (its receive step). Core owns the rest: the round on both sides, the
transaction around the model, the hooks, the shared transport pieces. Import
from here; the submodules behind these names may move.

Trainer side
    `TrainerInitInfo`, `TrainerWeightTransferEngine` (the spec's ABC, whose
    `open_round` drives a round), `ResyncTrainerEngine` (full resync: supply
    `transmit`), `Transfer`, `TrainerRound`, `RoundClient`, `AlignedFailure`,
    `checked_iteration`, `all_finite`, `first_non_finite` (batched, one host read),
    `track_sync` / `SyncTracker` (for rounds driven by hand), `trainer_device` (a
    trainer init info's default device).

Worker side
    `WeightTransferEngine` (the transaction lives in its base class, which
    also rolls back a stalled round and answers `ABORT_FIELD` with
    `RoundAbortedError`; `ModelIncompleteError` when a round without an undo
    record failed),
    `WeightTransferInitInfo`, `WeightTransferUpdateInfo`,
    `ParamListUpdateInfo` / `param_list_payload` (the shared per-round
    parameter list), `WeightLoader` / `Transaction` / `DirectLoader` /
    `loader_for` / `register_loader_provider`, `is_vllm_config`,
    `WorkerPosition` / `worker_position`; inside vLLM, `quiet_reload_warnings`
    (for a backend that reloads some layers on purpose).

Slices
    `record_slices` (a dry run of the model's loading code over recording
    tensors: which slice of each tensor lands where), `Scatter`, `FetchKey`,
    `apply_chain` (the producer's replay, allowlisted ops only),
    `UnsupportedOp`, `ALLOWED_OPS`, `describe_chain`, `SliceLoader` (the
    loaders' dry run and direct slice writes).

Payloads
    `parse_payload` / `payload_of` (dataclass <-> JSON-safe dict, errors name
    the field), `UpdatePayload`, the dtype codec (`dtype_name`,
    `dtype_from_name`, `WIRE_DTYPES`), the wire-protocol declaration
    (`WireProtocolInfo`, `WIRE_PROTOCOL_VERSION`, `ProtocolMismatchError`).

Limits
    `check_timeout`, `check_int_range`, `check_staging`, `check_declared`,
    `host_memory_bytes`, `MAX_TIMEOUT_S`, `MAX_BUFFERS`: refusals that name the
    field, the value and the limit.

Transport
    Groups: `StatelessGroup`, `GroupChannel` / `ChannelDownError` / `Link`,
    `GroupTrainerFields`, `GroupInitInfo`, `trainer_rendezvous`, `join_group`,
    `free_port`. Colocated: `SharedSegment` (named shared memory),
    `LocalListener` / `connect_local` / `LocalLink` / `Frame` / `LinkClosed`
    (a control link over a Unix socket), `Credits` / `RELEASED` (bucket
    releases as futures). Layout: `WireParams`, `plan_buckets`,
    `plan_per_tensor`, `PlanCache`, `BucketPlan`, `Bucket`, `Piece`,
    `as_bytes`, `RotatingBuffers`, `Packer`, `Unpacker`. Streaming: `SendWindow`,
    `LoadPipeline`, `LoadFailed`, `aligned_layout` (the layout both ends derive).
    Verified bytes: `BucketDigests` (per-piece digests of a bucket, computed
    and checked on the bytes' device), `DigestMismatch`, `DigestRoom` (digests
    in a staging buffer's tail), `digest`, `DIGEST_DTYPE`, `RECEIVE_HOOKS` and
    `run_receive_hooks` (a transport calls it on each received piece before
    checking it: the test-only hooks corrupt bytes there). Re-admission:
    `Refusal` / `refused` (structured refusals: a side without a group says
    `Refusal.NO_CONNECTION`, and the trainer then calls its `reconnect`).
    Waiting: `in_background`, `await_transfer`,
    `wait_for`, `work_future`, `all_settle`, `PEER_GRACE_S`, `CollectiveError`,
    `TransferTimeout`.
"""

from __future__ import annotations

from weight_transfer.base import (
    ABORT_FIELD,
    ModelIncompleteError,
    RoundAbortedError,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    UpdatePayload,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    synchronize_device,
    trainer_device,
)
from weight_transfer.control import Refusal, refused
from weight_transfer.dtypes import WIRE_DTYPES, dtype_from_name, dtype_name
from weight_transfer.hooks import SyncTracker, track_sync
from weight_transfer.limits import (
    MAX_BUFFERS,
    MAX_TIMEOUT_S,
    check_declared,
    check_int_range,
    check_staging,
    check_timeout,
    host_memory_bytes,
)
from weight_transfer.loading import (
    DirectLoader,
    Revertible,
    SliceLoader,
    Transaction,
    WeightLoader,
    is_vllm_config,
    loader_for,
    register_loader_provider,
)
from weight_transfer.payload import parse_payload, payload_of
from weight_transfer.position import WorkerPosition, worker_position
from weight_transfer.resync import (
    PARAM_LIST_FIELDS,
    ParamListUpdateInfo,
    ResyncTrainerEngine,
    param_list_digests,
    param_list_payload,
)
from weight_transfer.rounds import AlignedFailure, RoundClient, TrainerRound, Transfer
from weight_transfer.slices import (
    ALLOWED_OPS,
    FetchKey,
    Scatter,
    SliceRecord,
    UnsupportedOp,
    apply_chain,
    describe_chain,
    record_slices,
)
from weight_transfer.source import (
    ParamMeta,
    WeightSource,
    all_finite,
    checked_iteration,
    first_non_finite,
    layer_key,
    layerwise_groups,
)
from weight_transfer.transport.channel import (
    ChannelDownError,
    GroupChannel,
    Link,
)
from weight_transfer.transport.digest import (
    DIGEST_DTYPE,
    RECEIVE_HOOKS,
    BucketDigests,
    DigestMismatch,
    DigestRoom,
    digest,
    run_receive_hooks,
)
from weight_transfer.transport.group import StatelessGroup, free_port
from weight_transfer.transport.local import (
    RELEASED,
    Credits,
    Frame,
    LinkClosed,
    LocalLink,
    LocalListener,
    connect_local,
)
from weight_transfer.transport.packing import (
    Bucket,
    BucketPlan,
    Packer,
    Piece,
    PlanCache,
    RotatingBuffers,
    Unpacker,
    WireParams,
    aligned_layout,
    as_bytes,
    plan_buckets,
    plan_per_tensor,
)
from weight_transfer.transport.rendezvous import (
    GroupInitInfo,
    GroupTrainerFields,
    fleet_of,
    join_group,
    trainer_rendezvous,
)
from weight_transfer.transport.shm import SharedSegment
from weight_transfer.transport.stream import LoadFailed, LoadPipeline, SendWindow
from weight_transfer.vllm.loader import RELOAD_LOGGER, quiet_reload_warnings
from weight_transfer.waiting import (
    PEER_GRACE_S,
    CollectiveError,
    TransferTimeout,
    all_settle,
    await_transfer,
    in_background,
    wait_for,
    work_future,
)
from weight_transfer.wire import (
    WIRE_PROTOCOL_VERSION,
    ProtocolMismatchError,
    WireProtocolInfo,
)

__all__ = [
    # trainer side
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "ResyncTrainerEngine",
    "TrainerRound",
    "Transfer",
    "RoundClient",
    "AlignedFailure",
    "VLLMWeightSyncClient",
    "WeightSource",
    "ParamMeta",
    "checked_iteration",
    "all_finite",
    "first_non_finite",
    "layerwise_groups",
    "layer_key",
    "track_sync",
    "SyncTracker",
    # worker side
    "WeightTransferEngine",
    "RoundAbortedError",
    "ModelIncompleteError",
    "ABORT_FIELD",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "ParamListUpdateInfo",
    "param_list_payload",
    "param_list_digests",
    "PARAM_LIST_FIELDS",
    "Transaction",
    "WeightLoader",
    "Revertible",
    "DirectLoader",
    "SliceLoader",
    "loader_for",
    "register_loader_provider",
    "is_vllm_config",
    "WorkerPosition",
    "worker_position",
    "synchronize_device",
    "trainer_device",
    "quiet_reload_warnings",
    "RELOAD_LOGGER",
    # payloads
    "UpdatePayload",
    "parse_payload",
    "payload_of",
    "WIRE_DTYPES",
    "dtype_name",
    "dtype_from_name",
    "WireProtocolInfo",
    "WIRE_PROTOCOL_VERSION",
    "ProtocolMismatchError",
    # limits
    "MAX_TIMEOUT_S",
    "MAX_BUFFERS",
    "check_timeout",
    "check_int_range",
    "check_staging",
    "check_declared",
    "host_memory_bytes",
    # transport
    "StatelessGroup",
    "free_port",
    "GroupChannel",
    "ChannelDownError",
    "Link",
    "Refusal",
    "refused",
    "SharedSegment",
    "LocalListener",
    "LocalLink",
    "connect_local",
    "Frame",
    "LinkClosed",
    "Credits",
    "RELEASED",
    "GroupTrainerFields",
    "fleet_of",
    "GroupInitInfo",
    "trainer_rendezvous",
    "join_group",
    "WireParams",
    "plan_buckets",
    "plan_per_tensor",
    "BucketPlan",
    "Bucket",
    "Piece",
    "as_bytes",
    "aligned_layout",
    "BucketDigests",
    "DigestMismatch",
    "DigestRoom",
    "DIGEST_DTYPE",
    "RECEIVE_HOOKS",
    "digest",
    "run_receive_hooks",
    # slices (record once, replay every round)
    "ALLOWED_OPS",
    "FetchKey",
    "Scatter",
    "SliceRecord",
    "UnsupportedOp",
    "apply_chain",
    "describe_chain",
    "record_slices",
    "RotatingBuffers",
    "PlanCache",
    "Packer",
    "Unpacker",
    "SendWindow",
    "LoadPipeline",
    "LoadFailed",
    "in_background",
    "await_transfer",
    "wait_for",
    "work_future",
    "all_settle",
    "PEER_GRACE_S",
    "CollectiveError",
    "TransferTimeout",
]
