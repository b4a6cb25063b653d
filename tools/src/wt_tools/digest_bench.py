"""The cost of verified bytes' digests (`verify=True`) on their own, against a copy.

For two buckets of about 32 MiB on one device, dense (8 float32 tensors of
4 MiB) and many small pieces (4,000 bf16 tensors of 8 KiB), times in one run,
interleaved round by round after a warm-up: a copy of the bucket's bytes
into another buffer (the memcpy every transport pays at least once) and
`BucketDigests.of` of the bucket (what the trainer and each worker add per
bucket). On CPU at 1 and at 2 threads. Figures are medians, in seconds per
GiB and as a ratio to the copy.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["BUCKETS", "measure"]

# name -> (tensors, elements each, dtype)
BUCKETS: dict[str, tuple[int, int, torch.dtype]] = {
    "32 MiB, 8 tensors of 4 MiB": (8, 1 << 20, torch.float32),
    "31 MiB, 4000 tensors of 8 KiB": (4000, 4096, torch.bfloat16),
}


def _bucket(count: int, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """A one-bucket plan of `count` tensors and random bytes for it on `device`."""
    from weight_transfer.backend import ParamMeta
    from wt_kits.stream import plan_buckets

    metas = [ParamMeta(f"layers.0.p{i}", dtype, (numel,)) for i in range(count)]
    nbytes = sum(m.nbytes for m in metas) * 2
    plan = plan_buckets(metas, buffer_bytes=nbytes, min_bucket_bytes=nbytes)
    if len(plan.buckets) != 1:
        raise RuntimeError(f"expected one bucket, got {len(plan.buckets)}")
    g = torch.Generator().manual_seed(count)
    raw = torch.randint(0, 256, (plan.buckets[0].nbytes,), dtype=torch.uint8, generator=g)
    return plan, raw.to(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _medians(plan: Any, buf: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of a copy of `buf` and of its digests, interleaved after a warm-up."""
    from wt_kits.stream import BucketDigests

    copy = torch.empty_like(buf)
    digests = BucketDigests(plan)
    calls: dict[str, Callable[[], Any]] = {
        "memcpy": functools.partial(copy.copy_, buf),
        "digest": functools.partial(digests.of, 0, buf),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(repeats + 1):  # round 0 warms up
        for key, call in calls.items():
            seconds = _timed(call, buf.device)
            if r:
                times[key].append(seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(repeats: int, device: str = "cpu", threads: Sequence[int] = (1, 2)) -> dict[str, Any]:
    """Every figure (module docstring) in a JSON-safe dict: `rows`, one per bucket and
    thread count, with `memcpy_s_per_gib`, `digest_s_per_gib` and `x_memcpy`."""
    where = torch.device(device)
    counts = list(threads) if where.type == "cpu" else [torch.get_num_threads()]
    before = torch.get_num_threads()
    rows = []
    try:
        for name, (count, numel, dtype) in BUCKETS.items():
            plan, buf = _bucket(count, numel, dtype, where)
            gib = buf.numel() / 2**30
            for n in counts:
                torch.set_num_threads(n)
                med = _medians(plan, buf, repeats)
                rows.append(
                    {
                        "bucket": name,
                        "device": str(where),
                        "threads": n,
                        "bytes": buf.numel(),
                        "pieces": count,
                        "memcpy_s_per_gib": med["memcpy"] / gib,
                        "digest_s_per_gib": med["digest"] / gib,
                        "x_memcpy": med["digest"] / med["memcpy"],
                    }
                )
    finally:
        torch.set_num_threads(before)
    return {"repeats": repeats, "rows": rows}
