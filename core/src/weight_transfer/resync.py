"""Full-resync backends: the whole model every round, from a `WeightSource`.

`ResyncTrainerEngine` is the trainer side with the round written once. A
backend subclasses it and supplies its transmit step; `send_weights` does the
rest on every rank, from the engine's source or the round's own
(`send_weights(source=...)`, e.g. a `StreamedSource` of tensors handed over on
the call):

1. `metadata()` on every rank (it may be a collective); a non-sender then
   iterates the source (staying in its trainer-side collectives) and returns;
2. `check_ready()` and `num_chunks(metas)`, before any call reaches the
   workers, so a refused plan leaves nothing open; a channel that is down
   (`ChannelDownError`: torn down by a failed round) is re-formed first where
   the backend can (`reconnect`);
3. `open_round` (`start_weight_update`, hooks), then `update_weights(
   update_info(metas))` in flight while `transmit(metas, pairs, transfer)`
   moves the bytes; `pairs` is the source's iteration checked against its
   metadata (`checked_iteration`: the first disagreement raises naming the
   parameter before it reaches the wire), and, while `check_finite` (the
   default), refuses a floating tensor holding NaN or infinity (per tensor, or
   per bucket in `transmit` where `finite_per_bucket`);
4. the workers' answer, then `finish_weight_update(weight_version)`.

A round may also take its tensors in several chunks, streamed in order between
one start and one finish: `begin()`, `send_weight_chunk(source)` per chunk
(each steps 1-3 for its tensors), `end(weight_version)`; the finish commits
every chunk or, after any failure (`abort(reason)`, a chunk that raised), none.

`ParamListUpdateInfo` is the per-round update info most full-resync backends
need (names, wire dtype names and shapes, in metadata order).
"""

from __future__ import annotations

import hashlib
import json
import logging
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, ClassVar, Generic, TypeVar

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferUpdateInfo,
)
from weight_transfer.payload import dtype_from_name, dtype_name
from weight_transfer.rounds import TrainerRound, Transfer
from weight_transfer.runtime.control import ChannelDownError
from weight_transfer.runtime.sources import source_view
from weight_transfer.source import ParamMeta, WeightSource, checked_iteration

__all__ = [
    "ResyncTrainerEngine",
    "ParamListUpdateInfo",
    "param_list_payload",
    "PARAM_LIST_FIELDS",
    "param_list_digests",
    "LayoutMemo",
]

TInfo = TypeVar("TInfo", bound=TrainerInitInfo)
logger = logging.getLogger("weight_transfer")


def param_list_payload(metas: list[ParamMeta]) -> dict[str, Any]:
    """The `ParamListUpdateInfo` fields of `metas`, JSON-safe."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


PARAM_LIST_FIELDS = ("names", "dtype_names", "shapes")


def param_list_digests(payload: Any) -> list[int]:
    """One signed 64-bit digest per field of `PARAM_LIST_FIELDS` of `payload` (a dict, or
    an object holding those fields).

    A transport puts the trainer's digests on its own wire (the nccl header,
    say) so that a worker can tell, before it sizes a single receive, that the
    update info it was handed declares exactly the layout the trainer sends,
    and name the field that differs when it does not.
    """
    digests = []
    for text in _raw_layout(payload):
        blob = json.dumps(text, separators=(",", ":")).encode()
        digest = hashlib.blake2b(blob, digest_size=8).digest()
        digests.append(int.from_bytes(digest, "little", signed=True))
    return digests


def _raw_layout(payload: Any) -> tuple[Any, ...]:
    get = payload.get if isinstance(payload, dict) else lambda f: getattr(payload, f)
    return tuple(get(f) for f in PARAM_LIST_FIELDS)


@dataclass
class ParamListUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata: the parameters in wire order; `metas` is the decoded list.

    Lists of different lengths, a negative dimension or a dtype outside the
    allowlist raise `ValueError` naming the field and index.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    _metas: list[ParamMeta] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dtype_names", "shapes"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(
                    f"update_info: field {name!r} has {len(getattr(self, name))} entries, "
                    f"'names' has {len(self.names)}"
                )
        if min(chain.from_iterable(self.shapes), default=0) < 0:  # one C-level pass
            i = next(i for i, shape in enumerate(self.shapes) if min(shape, default=0) < 0)
            raise ValueError(f"update_info: field 'shapes[{i}]' has a negative dimension")
        for d in set(self.dtype_names):  # each distinct name once; the error names the first
            try:
                dtype_from_name(d)
            except ValueError:
                i = self.dtype_names.index(d)
                dtype_from_name(d, field=f"dtype_names[{i}]")

    @property
    def nbytes(self) -> int:
        """The bytes of the round's parameters (what this update moves)."""
        return sum(meta.nbytes for meta in self.metas)

    @property
    def metas(self) -> list[ParamMeta]:
        """The decoded parameter list (decoded on first use; `LayoutMemo` reuses it)."""
        if self._metas is None:
            dtypes = {d: dtype_from_name(d) for d in set(self.dtype_names)}
            self._metas = [
                ParamMeta(n, dtypes[d], tuple(s))
                for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
            ]
        return self._metas


class LayoutMemo:
    """One worker engine's memory of the last parameter list it received: the decoded
    `ParamMeta`s and the digests, reused while the list arrives unchanged (a model's
    does, round after round, and decoding tens of thousands of entries costs far more
    than comparing the lists). Each engine holds its own; engines share nothing."""

    def __init__(self) -> None:
        self._raw: tuple[Any, ...] | None = None  # copies of the last lists
        self._metas: list[ParamMeta] = []
        self._digests: list[int] = []

    def metas(self, info: ParamListUpdateInfo) -> list[ParamMeta]:
        """`info.metas`, decoded once per distinct parameter list."""
        self._remember(info)
        return self._metas

    def digests(self, info: ParamListUpdateInfo) -> list[int]:
        """`param_list_digests(info)`, computed once per distinct parameter list."""
        self._remember(info)
        return self._digests

    def _remember(self, info: ParamListUpdateInfo) -> None:
        raw = _raw_layout(info)
        if raw == self._raw:
            info._metas = self._metas  # frozen ParamMetas: sharing them is safe
            return
        self._metas = info.metas
        self._digests = param_list_digests(info)
        # copies: the caller's lists may change after this round
        self._raw = tuple([list(x) if isinstance(x, list) else x for x in v] for v in raw)


class ResyncTrainerEngine(TrainerWeightTransferEngine[TInfo], Generic[TInfo]):
    """A full-resync trainer engine: the backend supplies `transmit`; see the module doc.

    Without a `source` at construction every round names its own
    (`send_weights(source=...)`, `send_weight_chunk`).
    """

    #: True for a backend whose `transmit` runs the finite check itself while
    #: `check_finite`, batched per bucket (`Packer(finite=...)`, one host read a
    #: bucket); its `pairs` are then checked for names, dtypes and shapes only.
    #: False: the iteration checks each tensor (one host read a tensor).
    finite_per_bucket: ClassVar[bool] = False

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool | None = None,
        timeout_s: float | None = None,
        rank: int | None = None,
        info: TInfo | None = None,
    ) -> None:
        super().__init__(
            client=client,
            source=source,
            is_sender=is_sender,
            timeout_s=timeout_s,
            rank=rank,
            info=info,
        )
        self.check_finite = True
        self._own_source = source  # as given: what its rounds ask for an adapter
        self._chunked: TrainerRound | None = None  # the round `begin()` opened

    def send_weights(
        self, weight_version: str | None = None, *, source: WeightSource | None = None
    ) -> None:
        """One full round; returns with nothing in flight.

        `weight_version` labels the new weights; the workers commit it in the
        same `finish_weight_update` that commits the weights. `source`: this
        round's tensors (default: the engine's source).
        """
        given, source = source, self._source_of(source)
        metas = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        self._ready()
        num_chunks = self.num_chunks(metas)
        self.client.adapter_source = self._own_source if given is None else given
        round_ = self.open_round(
            num_params=len(metas),
            total_bytes=sum(m.nbytes for m in metas),
            num_chunks=num_chunks,
        )
        self._send(round_, metas, source)
        round_.finish(weight_version)

    def begin(self) -> None:
        """Open a round that takes its tensors in chunks (`send_weight_chunk`), until
        `end` commits them all or `abort` drops them all."""
        if not self.is_sender:
            return
        if self._chunked is not None:
            raise RuntimeError("begin() called twice without end() or abort()")
        self._ready()
        self.client.adapter_source = self._own_source
        self._chunked = self.open_round(num_params=0, total_bytes=0, num_chunks=0)

    def send_weight_chunk(self, source: WeightSource) -> None:
        """Send `source`'s tensors into the round `begin()` opened, after the chunks
        before it. A chunk that fails ends the round: every worker rolls all of
        it back (do not call `end`)."""
        source = source_view(source, None)
        metas = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        round_ = self._chunked
        if round_ is None:
            raise RuntimeError("send_weight_chunk() without begin() (or after a chunk failed)")
        tracker = round_.tracker
        tracker.num_chunks += self.num_chunks(metas)
        tracker.num_params += len(metas)
        tracker.total_bytes += sum(m.nbytes for m in metas)
        try:
            self._send(round_, metas, source)
        finally:
            if round_.closed:
                self._chunked = None

    def end(self, weight_version: str | None = None) -> None:
        """Commit every chunk of the round `begin()` opened, labeled `weight_version`."""
        if not self.is_sender:
            return
        round_, self._chunked = self._chunked, None
        if round_ is None:
            raise RuntimeError("end() without begin() (or after a chunk failed)")
        round_.finish(weight_version)

    def abort(self, reason: str) -> None:
        """Drop the round `begin()` opened, if any: every worker rolls it back."""
        round_, self._chunked = self._chunked, None
        if round_ is not None:
            round_.abort(reason)

    def _source_of(self, source: WeightSource | None) -> WeightSource:
        if source is not None:
            return source_view(source, None)
        if self.source is None:
            raise ValueError(
                f"{self.backend}: no WeightSource: give trainer_init one, or send_weights(source=)"
            )
        return self.source

    def _ready(self) -> None:
        """`check_ready()`; a channel that is down is re-formed first where the backend can."""
        try:
            self.check_ready()
        except ChannelDownError as down:
            if not self.can_reconnect:
                raise
            logger.warning("%s: re-forming the channel before the round (%s)", self.backend, down)
            self.reconnect()
            self.check_ready()

    def _send(self, round_: TrainerRound, metas: list[ParamMeta], source: WeightSource) -> None:
        finite = self.check_finite and not self.finite_per_bucket
        round_.update(
            self.update_info(metas),
            lambda transfer: self.transmit(
                metas, checked_iteration(metas, source, finite=finite), transfer
            ),
        )

    def check_ready(self) -> None:
        """Raise if the channel cannot carry a round (before anything is called)."""

    def num_chunks(self, metas: list[ParamMeta]) -> int:
        """How many chunks `transmit` will report; may validate the plan (raise to refuse)."""
        return len(metas)

    def update_info(self, metas: list[ParamMeta]) -> dict[str, Any]:
        """The round's update info; by default `param_list_payload(metas)`."""
        return param_list_payload(metas)

    @abstractmethod
    def transmit(
        self,
        metas: list[ParamMeta],
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        transfer: Transfer,
    ) -> None:
        """Move every tensor of `pairs` (checked against `metas`) to the workers.

        Exhaust `pairs` (the check for an extra tensor runs at its end), wait
        through `transfer.wait` and report chunks with `transfer.chunk_moved`.
        Return only when nothing is in flight. Raise `AlignedFailure(error)`
        when the round failed but the workers stopped at the same point.
        """
