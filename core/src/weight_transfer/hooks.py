"""Lifecycle hooks of a sync, on pluggy.

Every trainer engine reports through `track_sync(...)`, which calls the hooks
below on the sending rank. Implementations come from
`register_hooks(obj)` and from installed distributions' entry points in the
group `weight_transfer.hooks` (loaded on first use). A hook that raises is
logged and never breaks a sync.

Hook specifications (all keyword arguments; implement any subset):

- `wt_sync_started(backend, sync_id, num_params, total_bytes)`: the round
  opened (`start_weight_update` returned).
- `wt_chunk_moved(backend, sync_id, index, num_chunks, nbytes)`: one chunk
  (bucket, tensor or patch batch) left the sender.
- `wt_sync_finished(backend, sync_id, num_params, total_bytes, seconds,
  weight_version)`: the workers finished the round.
- `wt_sync_failed(backend, sync_id, error, seconds)`: the round raised; `error`
  is the exception about to propagate.

`sync_id` counts rounds per trainer engine, from 1.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pluggy

__all__ = ["hookspec", "hookimpl", "plugin_manager", "register_hooks", "track_sync", "SyncTracker"]

PROJECT = "weight_transfer"
ENTRY_POINT_GROUP = "weight_transfer.hooks"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
logger = logging.getLogger("weight_transfer")


class SyncHookSpecs:
    @hookspec
    def wt_sync_started(
        self, backend: str, sync_id: int, num_params: int, total_bytes: int
    ) -> None:
        """A round opened on the inference side."""

    @hookspec
    def wt_chunk_moved(
        self, backend: str, sync_id: int, index: int, num_chunks: int, nbytes: int
    ) -> None:
        """Chunk `index` of `num_chunks` (`nbytes` long) left the sender."""

    @hookspec
    def wt_sync_finished(
        self,
        backend: str,
        sync_id: int,
        num_params: int,
        total_bytes: int,
        seconds: float,
        weight_version: str | None,
    ) -> None:
        """The round completed on every worker."""

    @hookspec
    def wt_sync_failed(
        self, backend: str, sync_id: int, error: BaseException, seconds: float
    ) -> None:
        """The round failed with `error`, which propagates after the hooks."""


class LoggingProgress:
    """The built-in hooks: one log line per sync, and a progress line on stderr
    for syncs that run longer than `progress_after_s` when stderr is a terminal."""

    def __init__(self, progress_after_s: float = 2.0) -> None:
        self.progress_after_s = progress_after_s
        self._started: dict[tuple[str, int], float] = {}
        self._bytes: dict[tuple[str, int], int] = {}
        self._moved: dict[tuple[str, int], int] = {}
        self._shown = False

    @hookimpl
    def wt_sync_started(self, backend: str, sync_id: int, total_bytes: int) -> None:
        key = (backend, sync_id)
        self._started[key] = time.perf_counter()
        self._bytes[key] = total_bytes
        self._moved[key] = 0

    @hookimpl
    def wt_chunk_moved(self, backend: str, sync_id: int, nbytes: int) -> None:
        key = (backend, sync_id)
        if key not in self._started:
            return
        self._moved[key] += nbytes
        elapsed = time.perf_counter() - self._started[key]
        if elapsed >= self.progress_after_s and sys.stderr.isatty():
            total = max(self._bytes[key], 1)
            done = min(self._moved[key] / total, 1.0)
            bar = "#" * int(done * 30)
            sys.stderr.write(
                f"\r[wt {backend} sync {sync_id}] [{bar:<30}] {done:6.1%} "
                f"{self._moved[key] / 1e9 / elapsed:.2f} GB/s"
            )
            sys.stderr.flush()
            self._shown = True

    def _end_progress(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            self._shown = False

    @hookimpl
    def wt_sync_finished(
        self,
        backend: str,
        sync_id: int,
        num_params: int,
        total_bytes: int,
        seconds: float,
        weight_version: str | None,
    ) -> None:
        self._forget(backend, sync_id)
        rate = total_bytes / 1e9 / seconds if seconds > 0 else float("inf")
        logger.info(
            "wt %s sync %d: %d params, %.1f MB in %.3fs (%.2f GB/s)%s",
            backend,
            sync_id,
            num_params,
            total_bytes / 1e6,
            seconds,
            rate,
            f", version {weight_version}" if weight_version is not None else "",
        )

    @hookimpl
    def wt_sync_failed(
        self, backend: str, sync_id: int, error: BaseException, seconds: float
    ) -> None:
        self._forget(backend, sync_id)
        logger.error("wt %s sync %d failed after %.3fs: %s", backend, sync_id, seconds, error)

    def _forget(self, backend: str, sync_id: int) -> None:
        key = (backend, sync_id)
        self._started.pop(key, None)
        self._bytes.pop(key, None)
        self._moved.pop(key, None)
        self._end_progress()


_manager: pluggy.PluginManager | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process's hook manager: built-in hooks plus entry-point plugins."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(SyncHookSpecs)
        pm.register(LoggingProgress(), name="wt-logging-progress")
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        _manager = pm
    return _manager


def register_hooks(plugin: object, name: str | None = None) -> None:
    """Register an object whose `@hookimpl` methods implement hook specs."""
    plugin_manager().register(plugin, name=name)


def _call(hook_name: str, **kwargs: Any) -> None:
    """Call each implementation in pluggy's order; one that raises is logged and
    neither the sync nor the other implementations notice (wrappers are not run)."""
    hook = getattr(plugin_manager().hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            impl.function(*[kwargs[arg] for arg in impl.argnames])
        except Exception:  # observers must never break a sync
            logger.exception("weight_transfer hook %s of %s raised", hook_name, impl.plugin_name)


@dataclass
class SyncTracker:
    """Reports one round's progress; obtained from `track_sync`.

    An engine that learns a round's size as it goes (batches sent inside a
    round the caller opened) updates `num_params`, `total_bytes` and
    `num_chunks` here; `wt_sync_finished` reports the tracker's values.
    """

    backend: str
    sync_id: int
    num_params: int
    total_bytes: int
    num_chunks: int
    enabled: bool
    weight_version: str | None = None
    moved: int = field(default=0, init=False)

    def started(self) -> None:
        if self.enabled:
            _call(
                "wt_sync_started",
                backend=self.backend,
                sync_id=self.sync_id,
                num_params=self.num_params,
                total_bytes=self.total_bytes,
            )

    def chunk_moved(self, nbytes: int) -> None:
        index, self.moved = self.moved, self.moved + 1
        if self.enabled:
            _call(
                "wt_chunk_moved",
                backend=self.backend,
                sync_id=self.sync_id,
                index=index,
                num_chunks=self.num_chunks,
                nbytes=nbytes,
            )


@contextmanager
def track_sync(
    backend: str,
    sync_id: int,
    *,
    num_params: int,
    total_bytes: int,
    num_chunks: int,
    enabled: bool = True,
) -> Iterator[SyncTracker]:
    """Bracket one round: `wt_sync_finished` on normal exit, `wt_sync_failed` on error.

    The engine calls `tracker.started()` once the round is open and
    `tracker.chunk_moved(n)` per chunk; `enabled=False` (non-sender ranks)
    silences every hook.
    """
    tracker = SyncTracker(backend, sync_id, num_params, total_bytes, num_chunks, enabled)
    t0 = time.perf_counter()
    try:
        yield tracker
    except BaseException as e:
        if enabled:
            _call(
                "wt_sync_failed",
                backend=backend,
                sync_id=sync_id,
                error=e,
                seconds=time.perf_counter() - t0,
            )
        raise
    if enabled:
        _call(
            "wt_sync_finished",
            backend=backend,
            sync_id=sync_id,
            num_params=tracker.num_params,
            total_bytes=tracker.total_bytes,
            seconds=time.perf_counter() - t0,
            weight_version=tracker.weight_version,
        )
