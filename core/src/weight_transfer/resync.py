"""Full-resync backends: the whole model every round, from a fixed `WeightSource`.

`ResyncTrainerEngine` is the trainer side with the round written once. A
backend subclasses it and supplies its transmit step; `send_weights` does the
rest on every rank:

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
from typing import Any, ClassVar, Generic, TypeVar

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferUpdateInfo,
)
from weight_transfer.payload import dtype_from_name, dtype_name
from weight_transfer.rounds import Transfer
from weight_transfer.runtime.control import ChannelDownError
from weight_transfer.runtime.round_client import DEFAULT_TIMEOUT_S
from weight_transfer.source import ParamMeta, WeightSource, checked_iteration

__all__ = [
    "ResyncTrainerEngine",
    "ParamListUpdateInfo",
    "param_list_payload",
    "PARAM_LIST_FIELDS",
    "param_list_digests",
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


def param_list_digests(payload: dict[str, Any]) -> list[int]:
    """One signed 64-bit digest per field of `PARAM_LIST_FIELDS` in `payload`.

    A transport puts the trainer's digests on its own wire (the nccl header,
    say) so that a worker can tell, before it sizes a single receive, that the
    update info it was handed declares exactly the layout the trainer sends,
    and name the field that differs when it does not.
    """
    raw = _raw_layout(payload)
    last = _last_layout
    same = last is not None and last[0] == raw
    if same and last is not None and last[2] is not None:
        return list(last[2])
    digests = []
    for name in PARAM_LIST_FIELDS:
        text = json.dumps(payload[name], separators=(",", ":")).encode()
        digest = hashlib.blake2b(text, digest_size=8).digest()
        digests.append(int.from_bytes(digest, "little", signed=True))
    if same and last is not None:
        _remember(raw, last[1], digests)
    return digests


# The last parameter list decoded (`names, dtype_names, shapes`), its decoded
# `ParamMeta`s and its digests (None until asked for): a model's layout arrives
# unchanged round after round, and decoding tens of thousands of entries costs
# more than comparing the lists. Replaced whole, never mutated.
_last_layout: tuple[tuple[Any, ...], list[ParamMeta], list[int] | None] | None = None


def _raw_layout(payload: Any) -> tuple[Any, ...]:
    get = payload.get if isinstance(payload, dict) else lambda f: getattr(payload, f)
    return tuple(get(f) for f in PARAM_LIST_FIELDS)


def _remember(raw: tuple[Any, ...], metas: list[ParamMeta], digests: list[int] | None) -> None:
    global _last_layout
    # copies: the caller's lists may change after this round
    kept = tuple([list(x) if isinstance(x, list) else x for x in v] for v in raw)
    _last_layout = (kept, metas, digests)


@dataclass
class ParamListUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata: the parameters in wire order; `metas` is the decoded list.

    Lists of different lengths, a negative dimension or a dtype outside the
    allowlist raise `ValueError` naming the field and index.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    metas: list[ParamMeta] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        last = _last_layout
        if last is not None and last[0] == _raw_layout(self):
            self.metas = list(last[1])  # the ParamMetas are shared: frozen, compared by identity
            return
        for name in ("dtype_names", "shapes"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(
                    f"update_info: field {name!r} has {len(getattr(self, name))} entries, "
                    f"'names' has {len(self.names)}"
                )
        for i, shape in enumerate(self.shapes):
            if any(d < 0 for d in shape):
                raise ValueError(f"update_info: field 'shapes[{i}]' has a negative dimension")
        self.metas = [
            ParamMeta(n, dtype_from_name(d, field=f"dtype_names[{i}]"), tuple(s))
            for i, (n, d, s) in enumerate(
                zip(self.names, self.dtype_names, self.shapes, strict=True)
            )
        ]
        _remember(_raw_layout(self), list(self.metas), None)


class ResyncTrainerEngine(TrainerWeightTransferEngine[TInfo], Generic[TInfo]):
    """A full-resync trainer engine: the backend supplies `transmit`; see the module doc.

    Construction refuses a missing `source` (`ValueError`): a full resync
    re-reads the same source every round.
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
        source: WeightSource | None,
        is_sender: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if source is None:
            raise ValueError(
                f"{self.init_info_cls.backend} is a full-resync backend: trainer_init needs "
                "a WeightSource"
            )
        super().__init__(client=client, source=source, is_sender=is_sender, timeout_s=timeout_s)
        self.check_finite = True

    def send_weights(self, weight_version: str | None = None) -> None:
        """One full round; returns with nothing in flight.

        `weight_version` labels the new weights; the workers commit it in the
        same `finish_weight_update` that commits the weights.
        """
        source = self.source
        assert source is not None
        metas = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        try:
            self.check_ready()
        except ChannelDownError as down:
            if not self.can_reconnect:
                raise
            logger.warning("%s: re-forming the channel before the round (%s)", self.backend, down)
            self.reconnect()
            self.check_ready()
        num_chunks = self.num_chunks(metas)
        round_ = self.open_round(
            num_params=len(metas),
            total_bytes=sum(m.nbytes for m in metas),
            num_chunks=num_chunks,
        )
        round_.update(
            self.update_info(metas),
            lambda transfer: self.transmit(
                metas,
                checked_iteration(
                    metas, source, finite=self.check_finite and not self.finite_per_bucket
                ),
                transfer,
            ),
        )
        round_.finish(weight_version)

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
