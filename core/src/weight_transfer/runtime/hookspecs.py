"""The hook specification of a sync (pluggy).

Implement any subset of these on an object, mark each method with
`weight_transfer.runtime.hookspecs.hookimpl`, and register the object with
`weight_transfer.runtime.hooks.register_hooks` or advertise it in the entry-point
group `weight_transfer.hooks`. Calls pass keyword arguments; an
implementation names the ones it wants. Hooks run on the sending trainer rank
only, in the sync's own thread; they observe and must not block. Wrapper
hooks (`wrapper=True`, `hookwrapper=True`) are refused at registration: a
wrapper could hold or alter a round.

`sync_id` counts rounds per trainer engine, from 1.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookspec", "hookimpl", "SyncHookSpecs"]

PROJECT = "weight_transfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


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
