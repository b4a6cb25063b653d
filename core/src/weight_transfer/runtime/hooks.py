"""Lifecycle hooks of a sync: the manager, the built-in implementation, the tracker.

The specification is `weight_transfer.runtime.hookspecs`. Core's round
(`weight_transfer.rounds`) reports through a `SyncTracker` on the sending
rank; `track_sync(...)` makes one for engines that drive a round themselves.
Implementations come from `register_hooks(obj)` and from installed
distributions' entry points in the group `weight_transfer.hooks` (loaded on
first use). A hook that raises is logged and never breaks a sync; a wrapper
hook is refused with `ValueError` when it is registered.
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

from weight_transfer.runtime.hookspecs import PROJECT, SyncHookSpecs, hookimpl, hookspec

__all__ = [
    "hookspec",
    "hookimpl",
    "plugin_manager",
    "register_hooks",
    "track_sync",
    "SyncTracker",
    "LoggingProgress",
]

ENTRY_POINT_GROUP = "weight_transfer.hooks"
logger = logging.getLogger("weight_transfer")


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


def _refuse_wrappers(pm: pluggy.PluginManager, plugin: object) -> None:
    """Unregister `plugin` and raise if any of its hooks is a wrapper."""
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                name = pm.get_name(plugin)
                pm.unregister(plugin)
                raise ValueError(
                    f"weight_transfer hook {caller.name} of {name!r} is a wrapper; wrapper "
                    "hooks are not supported (they could hold or alter a round): implement "
                    "it as a plain hookimpl"
                )


def plugin_manager() -> pluggy.PluginManager:
    """The process's hook manager: built-in hooks plus entry-point plugins.

    Raises `ValueError` naming the plugin when an entry point provides a wrapper hook.
    """
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(SyncHookSpecs)
        pm.register(LoggingProgress(), name="wt-logging-progress")
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for _, plugin in pm.list_name_plugin():
            _refuse_wrappers(pm, plugin)
        _manager = pm
    return _manager


def register_hooks(plugin: object, name: str | None = None) -> None:
    """Register an object whose `@hookimpl` methods implement hook specs.

    Raises `ValueError` (and registers nothing) when one of them is a wrapper.
    """
    pm = plugin_manager()
    pm.register(plugin, name=name)
    _refuse_wrappers(pm, plugin)


def _call(hook_name: str, **kwargs: Any) -> None:
    """Call each implementation in pluggy's order; one that raises is logged and
    neither the sync nor the other implementations notice."""
    hook = getattr(plugin_manager().hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):
        try:
            impl.function(*[kwargs[arg] for arg in impl.argnames])
        except Exception:  # observers must never break a sync
            logger.exception("weight_transfer hook %s of %s raised", hook_name, impl.plugin_name)


@dataclass
class SyncTracker:
    """Reports one round to the hooks: `started()`, `chunk_moved(n)` per chunk,
    then exactly one of `finish()` or `fail(error)` (later calls are ignored).

    An engine that learns a round's size as it goes (batches sent inside a
    round the caller opened) updates `num_params`, `total_bytes` and
    `num_chunks`; `wt_sync_finished` reports the tracker's values.
    `enabled=False` (non-sender ranks) silences every hook.
    """

    backend: str
    sync_id: int
    num_params: int
    total_bytes: int
    num_chunks: int
    enabled: bool = True
    weight_version: str | None = None
    moved: int = field(default=0, init=False)
    ended: bool = field(default=False, init=False)
    _t0: float = field(default_factory=time.perf_counter, init=False, repr=False)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._t0

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

    def finish(self) -> None:
        """The round completed on every worker (`wt_sync_finished`)."""
        if self.ended:
            return
        self.ended = True
        if self.enabled:
            _call(
                "wt_sync_finished",
                backend=self.backend,
                sync_id=self.sync_id,
                num_params=self.num_params,
                total_bytes=self.total_bytes,
                seconds=self.seconds,
                weight_version=self.weight_version,
            )

    def fail(self, error: BaseException) -> None:
        """The round failed with `error`, which the caller raises (`wt_sync_failed`)."""
        if self.ended:
            return
        self.ended = True
        if self.enabled:
            _call(
                "wt_sync_failed",
                backend=self.backend,
                sync_id=self.sync_id,
                error=error,
                seconds=self.seconds,
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
    """A tracker for the block: `fail(error)` if it raises, else `finish()`.

    The engine calls `tracker.started()` once the round is open and
    `tracker.chunk_moved(n)` per chunk.
    """
    tracker = SyncTracker(backend, sync_id, num_params, total_bytes, num_chunks, enabled)
    try:
        yield tracker
    except BaseException as e:
        tracker.fail(e)
        raise
    tracker.finish()
