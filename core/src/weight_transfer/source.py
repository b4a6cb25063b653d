"""What to send: `ParamMeta`, `WeightSource`, `ModuleSource` and `layerwise_groups`.

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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import torch

from weight_transfer.runtime.finite import all_finite, non_finite_error

__all__ = [
    "ParamMeta",
    "WeightSource",
    "ModuleSource",
    "layerwise_groups",
    "materialize_full_tensor",
    "checked_iteration",
    "layer_key",
]


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as it travels: HF name, wire dtype, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


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


class WeightSource(ABC):
    """What a trainer sends. See the module docstring for the full contract."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter, in iteration order, without transferring anything."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """A fresh pass of fully materialized `(name, tensor)` pairs."""

    def held_names(self) -> Collection[str] | None:
        """Names this rank can produce; `None` (the default) means all of them."""
        return None

    def groups(self) -> list[list[str]]:
        """This rank's gather groups, in metadata order.

        `layerwise_groups(metadata())`, keeping only groups that hold at least one
        name of `held_names()`. An override must keep every leaf module's names in
        one group and must preserve metadata order.
        """
        all_groups = layerwise_groups(m.name for m in self.metadata())
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
        expected = iter([m.name for m in self.metadata()])
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


class ModuleSource(WeightSource):
    """A module's `named_parameters()`, plain or sharded (DTensor/FSDP2).

    `metadata()` reads each parameter's global shape and dtype, so it never
    gathers. Iteration materializes each parameter with `full_tensor()` when it
    is a DTensor (a collective: every rank must iterate) and detaches it.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.module.named_parameters():
            yield name, materialize_full_tensor(p.detach())


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
