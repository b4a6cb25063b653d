"""Slices: which bytes of each trainer tensor land where in a worker, recorded once.

`record_slices` runs the model's own loading code over recording tensors (the
loaders' dry run) and returns, per parameter, the chain of allowlisted view
ops from the trainer's tensor to each `Scatter` it writes. A producer replays
a chain (`apply_chain`) to cut exactly the bytes a worker loads; the worker
writes them with `SliceLoader`. The dry run itself belongs to the loader
protocol (`weight_transfer.runtime.slices`); this kit names what a backend uses.
"""

from weight_transfer.loading import SliceLoader
from weight_transfer.runtime.slices import (
    ALLOWED_OPS,
    FetchKey,
    Scatter,
    SliceRecord,
    UnsupportedOp,
    apply_chain,
    describe_chain,
    record_slices,
)

__all__ = [
    "ALLOWED_OPS",
    "FetchKey",
    "Scatter",
    "SliceLoader",
    "SliceRecord",
    "UnsupportedOp",
    "apply_chain",
    "describe_chain",
    "record_slices",
]
