"""Whether tensors hold NaN or infinity, checked per batch with one host read."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["first_non_finite", "all_finite", "non_finite_error"]

_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def first_non_finite(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first floating tensor of `tensors` holding a NaN or an
    infinity, or None when every one is finite.

    Batched: one L2 norm per tensor in one `torch._foreach_norm` per dtype (a NaN
    or an infinity makes it non-finite; the fused kernel reads at memory speed),
    and the host reads a single flag, whatever the number of tensors. Only when
    that flag is set is each flagged tensor checked element by element: a finite
    tensor whose norm overflows its dtype (float16 past 65,504) passes.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.dtype in _FINITE_CHECKED and tensor.numel() > 0:
            by_dtype.setdefault(tensor.dtype, []).append(i)
    if not by_dtype:
        return None
    order = [i for members in by_dtype.values() for i in members]
    norms = [
        torch.stack(torch._foreach_norm([tensors[i] for i in members], 2))
        for members in by_dtype.values()
    ]
    finite = torch.isfinite(norms[0] if len(norms) == 1 else torch.cat(norms))
    if bool(finite.all()):
        return None
    flagged = sorted(order[f] for f in (~finite).nonzero().flatten().tolist())
    return next((i for i in flagged if not bool(torch.isfinite(tensors[i]).all())), None)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in a floating `tensor` (one read pass, no copy, one host read)."""
    return first_non_finite([tensor]) is None


def non_finite_error(name: str, index: int) -> ValueError:
    """The refusal of parameter #`index`, `name`, for NaN or infinite values."""
    return ValueError(
        f"WeightSource yielded non-finite values (NaN or infinity) in {name!r} "
        f"(parameter #{index}); nothing of it was sent (set check_finite=False on the "
        "trainer engine to send such weights)"
    )
