"""What to send: `ParamMeta` (with `Replicate` / `Shard`), `WeightSource`, `layerwise_groups`.

Contract of a `WeightSource` (every backend may rely on it):

- `metadata()` lists every parameter's HF name, wire dtype and full (unsharded)
  shape without moving data. It runs on every trainer rank (it may be a
  collective) and describes the whole model on every rank.
- Iterating yields a fresh pass of `(name, tensor)` pairs that agree with
  `metadata()` element for element: same names, same order, same dtypes and
  shapes. Every rank iterates in lockstep, because materializing is usually a
  collective.
- With partial ownership (`held_names()` not `None`), iteration yields `None`
  in place of the tensor for a name this rank does not hold.
- A yielded tensor keeps its values while the pass runs: backends take a
  bucket's tensors before copying them in one batch, or send a tensor as it is
  while the next one is produced. A source that gathers into one reused buffer
  yields a copy of it.

A source may also be written as vLLM 0.33 writes one: `metadata` a
`functools.cached_property`, `iter_full()` (each parameter this rank owns, full)
and/or `iter_local()` (this rank's piece, as `ParamMeta.placements` lays it
out), `owned_names(rank)`; a `ParamMeta` then names its `owners`, `mesh_shape`
and `placements`. Trainer engines see every source through
`runtime.sources.source_view`, which gives such a source the contract above,
checked the same way; a source written either way has the other way's methods
too. `ModuleSource` (a module, plain or DTensor) lives in `runtime.sources`.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer.runtime.finite import all_finite, non_finite_error

__all__ = [
    "ParamMeta",
    "Replicate",
    "Shard",
    "Placement",
    "WeightSource",
    "metadata_of",
    "overrides",
    "layerwise_groups",
    "materialize_full_tensor",
    "checked_iteration",
    "layer_key",
]


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along this mesh axis holds the whole extent."""


@dataclass(frozen=True)
class Shard:
    """This mesh axis splits tensor dim `dim` the way `torch.chunk` does."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as it travels: HF name, wire dtype, full shape; and, for a source
    that declares it, who owns it and how (as vLLM 0.33 declares it).

    `owners`: the trainer ranks (`TrainerInitInfo.rank`) that own it, in mesh
    order; None means every rank. `mesh_shape`: the row-major shape of the mesh
    over `owners` (default `(len(owners),)`). `placements`: one `Replicate` or
    `Shard` per mesh axis, what `iter_local` yields on each owner (`Shard` splits
    as `torch.chunk` does, the outer mesh axis first); None means replicated.
    `ValueError` names the parameter when they do not fit together.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(
                    f"parameter {self.name!r}: field 'owners' is missing, but a mesh or "
                    "placements are declared"
                )
            return
        owners = tuple(self.owners)
        ranks_ok = all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in owners)
        if not owners or not ranks_ok or len(set(owners)) != len(owners):
            raise ValueError(
                f"parameter {self.name!r}: field 'owners' must list distinct non-negative "
                f"ranks, got {self.owners!r}"
            )
        mesh = tuple(self.mesh_shape) if self.mesh_shape is not None else (len(owners),)
        if any(d <= 0 for d in mesh) or math.prod(mesh) != len(owners):
            raise ValueError(
                f"parameter {self.name!r}: field 'mesh_shape' {list(mesh)} does not cover "
                f"its {len(owners)} owners"
            )
        placements = None if self.placements is None else tuple(self.placements)
        if placements is not None:
            if len(placements) != len(mesh):
                raise ValueError(
                    f"parameter {self.name!r}: field 'placements' has {len(placements)} "
                    f"entries for a {len(mesh)}-D mesh"
                )
            for p in placements:
                if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                    raise ValueError(
                        f"parameter {self.name!r}: field 'placements' shards dim {p.dim} of a "
                        f"{len(self.shape)}-D tensor"
                    )
                if not isinstance(p, (Shard, Replicate)):
                    raise ValueError(
                        f"parameter {self.name!r}: field 'placements' holds {p!r}, neither "
                        "Replicate nor Shard"
                    )
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "placements", placements)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def owned_by(self, rank: int) -> bool:
        return self.owners is None or rank in self.owners


def layer_key(name: str) -> tuple[str, int] | None:
    """`(prefix, index)` of the outermost all-digit dotted segment, or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layerwise_groups(names: Iterable[str]) -> list[list[str]]:
    """Partition names, in the order given, into one group per layer.

    A name's layer is its outermost integer segment together with the prefix
    before it, so `model.layers.3.mlp.experts.7.w1` belongs to layer 3 of
    `model.layers`. Consecutive names of the same layer form one group; a run of
    names without an integer segment (embeddings, final norm, `lm_head`, a
    projector between two stacks) forms a group of its own where it appears.

    Raises `ValueError` naming the offending name when a layer's names are not
    contiguous, because the partition (and every chunk boundary derived from it)
    would then depend on interleaving that other ranks need not share.
    """
    groups: list[list[str]] = []
    closed: set[tuple[str, int]] = set()
    current: tuple[str, int] | None = None
    started = False
    for name in names:
        key = layer_key(name)
        if not started or key != current:
            if current is not None:
                closed.add(current)
            if key is not None and key in closed:
                prefix, index = key
                raise ValueError(
                    f"layerwise_groups: {name!r} belongs to layer {index} of "
                    f"{prefix!r}, whose names already ended earlier; names sharing "
                    "a layer index must be contiguous in metadata order"
                )
            groups.append([])
            current = key
            started = True
        groups[-1].append(name)
    return groups


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full (unsharded) tensor: `full_tensor()` for a DTensor, else itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        result = full_tensor()
        assert isinstance(result, torch.Tensor)
        return result
    return tensor


class WeightSource(ABC):  # noqa: B024 - abstract by intent; either way of writing one is complete
    """What a trainer sends. See the module docstring for the full contract.

    Write `metadata()` and `__iter__` (wt's way), or a cached `metadata`
    and `iter_full()` / `iter_local()` (vLLM 0.33's way); either way the source
    answers both ways' calls (`source_view` is how engines call it).
    """

    def metadata(self) -> list[ParamMeta]:
        """Every parameter, in iteration order, without transferring anything."""
        raise NotImplementedError(f"{type(self).__name__} defines no metadata")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """A fresh pass of fully materialized `(name, tensor)` pairs."""
        raise NotImplementedError(f"{type(self).__name__} defines neither __iter__ nor iter_full")

    def held_names(self) -> Collection[str] | None:
        """Names this rank can produce; `None` (the default) means all of them."""
        return None

    def groups(self) -> list[list[str]]:
        """This rank's gather groups, in metadata order.

        `layerwise_groups(metadata())`, keeping only groups that hold at least one
        name of `held_names()`. An override must keep every leaf module's names in
        one group and must preserve metadata order.
        """
        all_groups = layerwise_groups(m.name for m in metadata_of(self))
        held = self.held_names()
        if held is None:
            return all_groups
        held_set = set(held)
        return [g for g in all_groups if any(n in held_set for n in g)]

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor | None]]]:
        """One `(names, tensors)` batch per group of `groups()`.

        The default drives `__iter__` and batches its output. Names of groups this
        rank skips are consumed and dropped. Raises `ValueError` naming the
        first name that arrives out of metadata order (as `checked_iteration`
        does), since out-of-order materialization deadlocks peers.
        """
        wanted = self.groups()
        group_of: dict[str, int] = {}
        for gi, names in enumerate(wanted):
            for n in names:
                group_of[n] = gi
        expected = iter([m.name for m in metadata_of(self)])
        batch_names: list[str] = []
        batch: list[torch.Tensor | None] = []
        gi_next = 0
        for name, tensor in self:
            want = next(expected, None)
            if name != want:
                raise ValueError(
                    f"iter_groups: {name!r} arrived where metadata order expects "
                    f"{want!r}; iteration must follow metadata() exactly"
                )
            if name not in group_of:
                continue
            batch_names.append(name)
            batch.append(tensor)
            if len(batch_names) == len(wanted[gi_next]):
                yield batch_names, batch
                batch_names, batch = [], []
                gi_next += 1
        leftover = next(expected, None)
        if leftover is not None or batch_names:
            missing = leftover if leftover is not None else wanted[gi_next][len(batch_names)]
            raise ValueError(
                f"iter_groups: iteration ended before {missing!r}; it must yield "
                "every name of metadata()"
            )

    # -- vLLM 0.33's names, for a source written wt's way ------------------
    def owned_names(self, rank: int) -> list[str]:
        """The names `rank` iterates, in metadata order (this rank's `held_names()`)."""
        held = self.held_names()
        return [
            m.name
            for m in metadata_of(self)
            if m.owned_by(rank) and (held is None or m.name in held)
        ]

    def implements_iter_full(self) -> bool:
        return overrides(self, "iter_full") or overrides(self, "__iter__")

    def implements_iter_local(self) -> bool:
        return overrides(self, "iter_local")

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensor of each name this rank holds (iteration without the Nones)."""
        for name, tensor in self:
            if tensor is not None:
                yield name, tensor

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's piece of each name it owns, as `ParamMeta.placements` lays it out."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


def overrides(source: Any, method: str) -> bool:
    """Whether `source`'s class overrides `method` of `WeightSource` (or, for a source
    that is no `WeightSource`, has it at all)."""
    own = inspect.getattr_static(type(source), method, None)
    return own is not None and own is not getattr(WeightSource, method)


def metadata_of(source: Any) -> list[ParamMeta]:
    """`source.metadata()`, or the list a source written as vLLM 0.33 writes one holds."""
    metadata = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def _describe(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{name!r} ({str(dtype).removeprefix('torch.')}, shape {list(shape)})"


def checked_iteration(
    metas: list[ParamMeta],
    pairs: Iterable[tuple[str, torch.Tensor | None]],
    *,
    finite: bool = False,
) -> Iterator[tuple[ParamMeta, torch.Tensor]]:
    """Iterate `pairs`, raising `ValueError` at the first divergence from `metas`.

    Checks, before a tensor can reach the wire, that the i-th pair has the i-th
    declared name, dtype and shape, that no extra pair follows and that none is
    missing; with `finite`, also that floating tensors hold no NaN or infinity.
    The message names the parameter and both sides.
    """
    it = iter(pairs)
    for i, meta in enumerate(metas):
        try:
            name, tensor = next(it)
        except StopIteration:
            raise ValueError(
                f"WeightSource iteration stopped after {i} parameters; metadata() "
                f"declares {len(metas)}, next {_describe(meta.name, meta.dtype, meta.shape)}"
            ) from None
        if tensor is None:
            raise ValueError(
                f"WeightSource yielded None for {meta.name!r} (parameter #{i}); a "
                "broadcast backend needs every tensor on the sending rank"
            )
        if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise ValueError(
                f"WeightSource iteration disagrees with metadata() at parameter #{i}: "
                f"iteration yielded {_describe(name, tensor.dtype, tuple(tensor.shape))}, "
                f"metadata() declares {_describe(meta.name, meta.dtype, meta.shape)}"
            )
        if finite and not all_finite(tensor):
            raise non_finite_error(meta.name, i)
        yield meta, tensor
    extra = next(it, None)
    if extra is not None:
        raise ValueError(
            f"WeightSource iteration yielded {extra[0]!r} after all {len(metas)} "
            "parameters declared by metadata()"
        )
