"""Bucketed streaming: the layout both ends derive, the loops that move it, its digests.

Trainer: `plan_buckets` (or `aligned_layout`, which adds the wire version's
alignment) over the round's `ParamMeta`s; `Packer` fills `RotatingBuffers`
inside a `SendWindow`. Worker: the same plan, `LoadPipeline` receiving into
rotating buffers while `Unpacker` loads the previous bucket. `BucketDigests`
checks each piece on the bytes' own device; `first_non_finite` finds a NaN or
an infinity in a batch of tensors with one host read.
"""

from weight_transfer.runtime.finite import first_non_finite
from wt_kits.stream.digests import (
    DIGEST_DTYPE,
    BucketDigests,
    DigestMismatch,
    DigestRoom,
    bucket_landed,
    digest,
)
from wt_kits.stream.packing import (
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
    floating_runs,
    plan_buckets,
    plan_per_tensor,
)
from wt_kits.stream.window import LoadFailed, LoadPipeline, SendWindow

__all__ = [
    "DIGEST_DTYPE",
    "Bucket",
    "BucketDigests",
    "BucketPlan",
    "DigestMismatch",
    "DigestRoom",
    "LoadFailed",
    "LoadPipeline",
    "Packer",
    "Piece",
    "PlanCache",
    "RotatingBuffers",
    "SendWindow",
    "Unpacker",
    "WireParams",
    "aligned_layout",
    "as_bytes",
    "digest",
    "first_non_finite",
    "floating_runs",
    "plan_buckets",
    "plan_per_tensor",
    "bucket_landed",
]
