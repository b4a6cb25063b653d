"""Fault injection for tests: corrupt bytes after they land, before they are checked.

Receivers built on wt-kits report every landed bucket (`wt_kits.stream.bucket_landed`);
a hook installed here sees those bytes first and may change them, which is how
the tests prove that a verified round refuses what the wire corrupted.
Hooks are per process; a worker process installs its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from wt_kits.stream import digests

__all__ = ["LandedHook", "on_bucket_landed", "install_bucket_hook"]

LandedHook = Callable[[int, torch.Tensor], None]  # (bucket index, its received bytes)


@contextlib.contextmanager
def on_bucket_landed(hook: LandedHook) -> Iterator[None]:
    """Run `hook` on every bucket this process receives, inside the block."""
    digests._LANDED.append(hook)
    try:
        yield
    finally:
        digests._LANDED.remove(hook)


def install_bucket_hook(hook: LandedHook | None) -> None:
    """Make `hook` this process's only one (None: none), until the next call."""
    digests._LANDED.clear()
    if hook is not None:
        digests._LANDED.append(hook)
