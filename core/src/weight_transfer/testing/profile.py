"""`Profile`: what the conformance suite needs to know to drive one backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["STREAM_WIRE_MODES", "Profile", "TrainerInfo"]

TrainerInfo = Callable[..., Any]
Sender = Callable[[Any, Mapping[str, torch.Tensor]], None]
"""`trainer_info(*, workers, wire, timeout_s, replace, workdir)` -> rank 0's
`TrainerInitInfo` for a trainer feeding `workers` worker processes: `wire` is
one of the profile's `wire_modes`, `timeout_s` bounds every wait, `replace`
asks to take over an engine another live trainer holds, `workdir` is a fresh
private directory (for a backend that needs one)."""


@dataclass(frozen=True)
class Profile:
    """How the conformance suite drives one backend.

    `backend`: the name both factories resolve (its entry points). The suite's
    workers create their engine through `WeightTransferEngineFactory`, so the
    backend must be installed, or importable from `sys_path` with its
    `.dist-info` there. `wire_modes`: named option sets every bit-exact check
    runs under (packed and unpacked, small buffers, ...). `knows_liveness`: the
    worker engine's `trainer_alive()` is True while its trainer lives, so a
    second trainer is refused rather than taking over. `send`: for a backend
    whose trainer takes no `WeightSource` (deltas), `send(engine, tensors)` runs
    one round that leaves every worker holding `tensors`; the suite then
    passes no source to `trainer_init` and skips the scenario of a source
    that disagrees with its metadata. `loads_by_name`: the worker loads
    through the model by parameter name (`load_weights`, the loader), so a
    name the model refuses fails the round on that worker (False for a
    backend that writes the parameters in place; the failing-worker
    scenario is skipped). `in_process`: the workers are threads of the test
    process (`WorkerPool(in_process=True)`), for a transport that reaches only
    its own process; the killed-worker scenario is skipped.
    """

    backend: str
    trainer_info: TrainerInfo
    wire_modes: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {"default": {}})
    sys_path: tuple[str, ...] = ()
    knows_liveness: bool = True
    send: Sender | None = None
    loads_by_name: bool = True
    in_process: bool = False

    @property
    def takes_source(self) -> bool:
        """Whether the trainer engine takes a `WeightSource` (no `send` given)."""
        return self.send is None

    def __str__(self) -> str:
        return self.backend


_SMALL = {"packed": True, "packed_buffer_size_bytes": 2048, "packed_min_bucket_bytes": 0}
STREAM_WIRE_MODES: Mapping[str, Mapping[str, Any]] = {
    "packed": {"packed": True, "packed_buffer_size_bytes": 1 << 20},
    "packed-small-buffers": {**_SMALL, "packed_num_buffers": 3},  # one tensor over many buckets
    "unpacked": {"packed": False, "packed_buffer_size_bytes": 2048},
    "verified-small-buffers": {**_SMALL, "verify": True},
    "verified-one-buffer": {"packed": True, "packed_buffer_size_bytes": 4096,
                            "packed_num_buffers": 1, "verify": True},
    "verified-unpacked": {"packed": False, "packed_buffer_size_bytes": 2048, "verify": True},
}  # fmt: skip
"""The wire modes of a backend whose trainer init info carries the stream kit's
`WireParams` (`wt_kits.stream`): packed, unpacked, small buffers,
one buffer, and verified bytes."""
