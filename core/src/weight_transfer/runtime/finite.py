"""Whether tensors hold NaN or infinity, checked per batch with one host read."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["first_non_finite", "all_finite", "non_finite_error"]

_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# float8 by its bytes: doubling a byte (uint8 wraps) drops the sign bit and leaves
# the other seven bits, shifted; the byte is NaN or infinite iff that is at least:
_FLOAT8_NON_FINITE = {
    torch.float8_e4m3fn: 0x7F << 1,  # S.1111.111 is NaN (no infinity)
    torch.float8_e5m2: 0x7C << 1,  # S.11111.xx is an infinity (xx = 0) or NaN
}


def first_non_finite(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first floating tensor of `tensors` holding a NaN or an
    infinity, or None when every one is finite.

    Batched: one L2 norm per tensor in one `torch._foreach_norm` per dtype (a NaN
    or an infinity makes it non-finite; the fused kernel reads at memory speed),
    and for float8, one largest byte per tensor, sign bit dropped (a doubled copy
    of its bytes), in one `torch._foreach_max` per dtype (a NaN or an infinity is
    a byte of all-ones exponent); the host reads a single flag, whatever the number of tensors. Only
    when that flag is set is each flagged tensor checked element by element: a
    finite tensor whose norm overflows its dtype (float16 past 65,504) passes. A
    flagged float8 tensor holds a NaN or an infinity.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        checked = tensor.dtype in _FINITE_CHECKED or tensor.dtype in _FLOAT8_NON_FINITE
        if checked and tensor.numel() > 0:
            by_dtype.setdefault(tensor.dtype, []).append(i)
    if not by_dtype:
        return None
    order = [i for members in by_dtype.values() for i in members]
    flags = [
        _finite_flags(dtype, [tensors[i] for i in members]) for dtype, members in by_dtype.items()
    ]
    finite = flags[0] if len(flags) == 1 else torch.cat(flags)
    if bool(finite.all()):
        return None
    flagged = sorted(order[f] for f in (~finite).nonzero().flatten().tolist())
    return next((i for i in flagged if not _all_finite_exact(tensors[i])), None)


def _finite_flags(dtype: torch.dtype, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor of `tensors` (all of `dtype`, none empty), on their device, False
    when it may hold a NaN or an infinity: exact for float8, and for other dtypes
    also False where the L2 norm overflows."""
    floor = _FLOAT8_NON_FINITE.get(dtype)
    if floor is None:
        return torch.isfinite(torch.stack(torch._foreach_norm(tensors, 2)))
    doubled = torch._foreach_mul([t.view(torch.uint8) for t in tensors], 2)
    return torch.stack(torch._foreach_max(doubled)) < floor


def _all_finite_exact(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in `tensor`, element by element."""
    if tensor.dtype in _FLOAT8_NON_FINITE:
        return bool(_finite_flags(tensor.dtype, [tensor]).all())
    return bool(torch.isfinite(tensor).all())


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in a floating `tensor` (one host read)."""
    return first_non_finite([tensor]) is None


def non_finite_error(name: str, index: int) -> ValueError:
    """The refusal of parameter #`index`, `name`, for NaN or infinite values."""
    return ValueError(
        f"WeightSource yielded non-finite values (NaN or infinity) in {name!r} "
        f"(parameter #{index}); nothing of it was sent (set check_finite=False on the "
        "trainer engine to send such weights)"
    )
