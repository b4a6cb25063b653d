"""Slices: which bytes of each trainer tensor land where in a worker, recorded once.

`record_slices` runs the model's own loading code over recording tensors (the
loaders' dry run) and returns, per parameter, the chain of allowlisted view
ops from the trainer's tensor to each `Scatter` it writes. A producer replays
a chain (`apply_chain`) to cut exactly the bytes a worker loads; the worker
writes them with `SliceLoader`. The dry run itself belongs to the loader
protocol (`weight_transfer.runtime.slices`); this kit names what a backend uses.
A chain is a tuple of `Op`s (`Chain`); `storage_id` tells tensors that share
storage apart. For sharded parameters: where each rank's piece lies
(`local_box`, `shard_boxes`, `unravel`; a `Box` is per dim `(start, length)`).
"""

from weight_transfer.loading import SliceLoader
from weight_transfer.runtime.slices import (
    ALLOWED_OPS,
    Chain,
    FetchKey,
    Op,
    Scatter,
    SliceRecord,
    UnsupportedOp,
    apply_chain,
    describe_chain,
    record_slices,
    storage_id,
)
from weight_transfer.runtime.sources import Box, local_box, shard_boxes, unravel

__all__ = [
    "ALLOWED_OPS",
    "Box",
    "Chain",
    "FetchKey",
    "Op",
    "Scatter",
    "SliceLoader",
    "SliceRecord",
    "UnsupportedOp",
    "apply_chain",
    "describe_chain",
    "local_box",
    "record_slices",
    "shard_boxes",
    "storage_id",
    "unravel",
]
