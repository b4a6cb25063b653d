"""Bounds on every size and wait a caller or the wire can choose.

Each check raises `ValueError` naming the payload, the field, the value and
the limit, so a refusal says exactly what to change:

- `check_timeout`: a finite number of seconds in `(0, MAX_TIMEOUT_S]`.
- `check_int_range`: an integer field within `[low, high]`.
- `check_staging`: `count` buffers of `nbytes` each fit in `STAGING_FRACTION`
  of the host's physical memory (a wire parameter that would make a worker
  allocate more is refused at init, before anything is allocated).
- `check_declared`: a round's declared parameters are no larger than the
  model that will receive them (per parameter and in total, counted in
  elements so a float32 trainer may feed a bfloat16 engine), and no larger
  than the host could stage; checked at `update_weights` before a byte is
  allocated.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence

import torch

from weight_transfer.source import ParamMeta

__all__ = [
    "MAX_TIMEOUT_S",
    "MAX_BUFFERS",
    "STAGING_FRACTION",
    "DECLARED_SLACK",
    "host_memory_bytes",
    "check_timeout",
    "check_int_range",
    "check_staging",
    "check_declared",
]

MAX_TIMEOUT_S = 3600.0
MAX_BUFFERS = 16
STAGING_FRACTION = 0.5
# A round may declare up to this many times the model's elements (checkpoint
# tensors a model ties or drops, padding the model lacks).
DECLARED_SLACK = 2.0


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_timeout(value: float, *, field: str, what: str) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S
    if not ok:
        raise ValueError(
            f"{what}: field {field!r} must be a finite number of seconds in "
            f"(0, {MAX_TIMEOUT_S:g}], got {value!r}"
        )


def check_int_range(value: int, *, field: str, what: str, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{what}: field {field!r} must be in [{low}, {high}], got {value!r}")


def check_staging(nbytes: int, count: int, *, field: str, what: str) -> None:
    limit = int(host_memory_bytes() * STAGING_FRACTION)
    if nbytes * count > limit:
        raise ValueError(
            f"{what}: field {field!r} of {nbytes} bytes x {count} buffers needs "
            f"{nbytes * count} bytes of staging, over the limit of {limit} bytes "
            f"({STAGING_FRACTION:.0%} of this host's memory)"
        )


def check_declared(metas: Sequence[ParamMeta], model: torch.nn.Module, *, what: str) -> None:
    """Refuse a round larger than `model` could hold (see the module doc).

    A layout this model already passed is not checked again (the same
    `ParamMeta`s as last round: compared by identity first, so an unchanged
    model costs no walk of its parameters).
    """
    key = tuple(metas)
    if _passed.get(model) == key:
        return
    model_numel = sum(p.numel() for p in model.parameters())
    if model_numel:  # a model without parameters of its own: only the host limit applies
        for i, meta in enumerate(metas):
            if meta.numel > model_numel:
                raise ValueError(
                    f"{what}: field 'shapes[{i}]' declares {meta.name!r} with {meta.numel} "
                    f"elements, more than the whole model ({model_numel})"
                )
        total = sum(m.numel for m in metas)
        limit = int(model_numel * DECLARED_SLACK)
        if total > limit:
            raise ValueError(
                f"{what}: the round declares {total} elements, over the limit of {limit} "
                f"({DECLARED_SLACK:g} x the model's {model_numel})"
            )
    limit_bytes = int(host_memory_bytes() * STAGING_FRACTION)
    total_bytes = sum(m.nbytes for m in metas)
    if total_bytes > limit_bytes:
        raise ValueError(
            f"{what}: the round declares {total_bytes} bytes, over the limit of "
            f"{limit_bytes} bytes ({STAGING_FRACTION:.0%} of this host's memory)"
        )
    _passed[model] = key


# The last layout each model passed `check_declared` with; it goes with the model.
_passed: weakref.WeakKeyDictionary[torch.nn.Module, tuple[ParamMeta, ...]] = (
    weakref.WeakKeyDictionary()
)
