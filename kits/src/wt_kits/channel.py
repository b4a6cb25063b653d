"""`GroupChannel`: one side's private group (or link), and why it is gone when it is.

A backend holds its `StatelessGroup` (or any object with the `Link` methods:
`abort`, `close`, `trainer_alive`; a colocated backend's control link, say)
through a channel. `require()` returns
the group or raises naming the reason there is none (never connected, shut
down, torn down after which failure) and what to do. `on_wire(doing)` brackets
the part of a round that exchanges collectives: if anything escapes it other
than an `AlignedFailure` (both sides stopped at the same point), the
collectives may be out of step, so the group is aborted and later rounds say
why. Errors raised before the wire is touched (validation, planning) leave the
group as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from weight_transfer.rounds import AlignedFailure
from weight_transfer.runtime.control import ChannelDownError, Refusal

__all__ = ["GroupChannel", "ChannelDownError", "Link"]


class Link(Protocol):
    """What a channel needs of the thing it holds."""

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def trainer_alive(self) -> bool: ...


L = TypeVar("L", bound=Link)


class GroupChannel(Generic[L]):
    """Owns one group (a `Link`) and its teardown reason. `remedy` ends every refusal."""

    def __init__(self, name: str, *, remedy: str) -> None:
        self.name = name
        self.remedy = remedy
        self.group: L | None = None
        self.holder = ""  # the trainer this side serves (workers), by its trainer_id
        self.reason = "it has not been connected yet"

    @property
    def connected(self) -> bool:
        return self.group is not None

    def connect(self, group: L, holder: str = "") -> None:
        """Hold `group` (for trainer `holder`), aborting a previous one (it may be out of step)."""
        self.drop("it was replaced by a new connection")
        self.group = group
        self.holder = holder

    def require(self) -> L:
        if self.group is None:
            # `Refusal.NO_CONNECTION`: a trainer that sees it from a worker re-forms the
            # group (`TrainerWeightTransferEngine.reconnect`).
            raise ChannelDownError(
                Refusal.NO_CONNECTION.say(
                    f"{self.name}: no transfer group ({self.reason}); {self.remedy}"
                )
            )
        return self.group

    def drop(self, reason: str) -> None:
        """Abort the group without waiting for collectives in flight."""
        if self.group is not None:
            self.group.abort()
            self.group = None
        self.reason = reason

    def close(self, reason: str = "the engine was shut down") -> None:
        """Release the group after a clean run."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.reason = reason

    @contextmanager
    def on_wire(self, doing: str) -> Iterator[L]:
        """The group, torn down if anything but `AlignedFailure` escapes the block."""
        group = self.require()
        try:
            yield group
        except AlignedFailure:
            raise
        except BaseException as error:
            if self.group is group:
                self.drop(
                    f"it was torn down after {doing} failed ({type(error).__name__}: {error})"
                )
            raise
