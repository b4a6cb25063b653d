"""Sparse patches (`sparse_nccl`) inside vLLM: a checkpoint-format mirror, reloaded layerwise.

A sparse patch is in checkpoint coordinates: a checkpoint (HF) name and flat
indices into the full tensor. A vLLM model does not hold those tensors (q/k/v
and gate/up are fused, tensor-parallel ranks hold shards, and on CPU Linear
weights are repacked into `cpu_linear`), so patches cannot be written into it
in place. `MirrorPatcher`, the `SparsePatcher` that `wt_sparse_nccl` uses
inside vLLM, works on a mirror of the checkpoint instead:

- `CheckpointMirror` (one per model, kept for the model's lifetime) knows the
  names, dtypes and shapes of the safetensors files vLLM loaded the model from
  (read from their headers), and holds the full tensors of every layer group a
  patch has touched so far: read from those files on first touch, then kept
  in memory and patched there.
- `begin` opens an undo log. `check` requires the patch's name to be a
  checkpoint tensor and its full shape and values dtype to be that tensor's
  (`ValueError`, nothing written). `apply` writes the entries into the mirror
  and logs the values they replace (O(nnz)).
- `commit` (the engine's `finish_weight_update`) reloads every layer group
  touched this round, all of the group's checkpoint tensors taken from the
  mirror, through `weight_transfer.loading.loader_for(model, vllm_config)` (the
  transactional layerwise reload of `weight_transfer.vllm.loader`), then drops
  the undo log. If the reload fails, the loader puts the model back and the
  undo log the mirror before the error propagates; the round is over and a
  second `commit` or `abort` is a no-op.
- `abort` restores the mirror; the model is not changed before `commit`, so it
  keeps serving its previous weights throughout a round (unlike a dense round,
  it is not on the meta device until `commit`).
- `commit(keep_undo=True)` (core's `Revertible`, for an all-or-nothing fleet
  round) commits with the reload's loader kept revertible (its snapshot) and
  keeps the undo log; `revert()` restores the model from that snapshot (what
  it served before the round, exactly) and the mirror from the log;
  `release()` drops both. The mirror's holder (`CheckpointMirror.held`) is
  released before another round writes into the mirror.

Layer groups are core's `layerwise_groups` over the checkpoint names, ordered
so each layer's names are contiguous: one group per numbered layer (all of
`model.layers.3.*`) and one group for every name outside numbered layers
(embeddings, final norm, `lm_head`). Reloading whole groups gives every vLLM
module of a touched layer all of its checkpoint tensors, so fused modules are
complete; modules of untouched layers keep their tensors (the loader is told
the round is `partial`, so vLLM's "Failed to load weights" warning for them is
dropped).

Costs per worker: memory, the touched groups in checkpoint dtype on the host
(up to one checkpoint-format copy of the model; every tensor-parallel rank
holds full tensors); per round, O(nnz) on the wire and in apply/undo, plus one
layerwise reload of the touched groups (a copy of each group is handed to the
loader; the loader's begin also snapshots the model's materialized tensors).

Assumptions: vLLM loaded the model with its default loader from safetensors
files, and those files still hold the weights the model served before its
first sparse round (a file that changes after the mirror first read it is
refused; at first use 1-D tensors are compared with the model's and a
mismatch is logged). Every vLLM module takes its checkpoint tensors from one
layer group. Secondary weight sources and draft models are not mirrored.
Changes made to the model by other paths (another reload, sleep level 2) are
not seen by the mirror.

`wt_sparse_nccl.worker` asks `vllm_patcher` first when the engine's
`vllm_config` is a vLLM config; this module (and vllm) is imported only then.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.backend import (
    Revertible,
    is_vllm_config,
    layer_key,
    layerwise_groups,
    loader_for,
)
from wt_sparse_nccl.patch import check_dtype

__all__ = ["CheckpointMirror", "MirrorPatcher", "vllm_patcher"]

logger = logging.getLogger("weight_transfer.vllm")

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _safetensors_dtype(name: str) -> torch.dtype | None:
    attr = _SAFETENSORS_DTYPES.get(name)
    dtype = getattr(torch, attr, None) if attr is not None else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _group_order(name: str) -> tuple[int, str, int]:
    key = layer_key(name)
    return (0, "", 0) if key is None else (1, key[0], key[1])


def checkpoint_files(model: torch.nn.Module, vllm_config: Any) -> list[str]:
    """The safetensors files vLLM's default loader reads for `vllm_config`'s model.

    `ValueError` when the model is loaded another way (dummy weights, GGUF,
    ...) or from a checkpoint that is not safetensors.
    """
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    load_config = vllm_config.load_config
    loader = get_model_loader(load_config)
    if not isinstance(loader, DefaultModelLoader):
        raise ValueError(
            f"sparse_nccl inside vLLM patches a mirror of the checkpoint files; load "
            f"format {load_config.load_format!r} reads no such files"
        )
    model_config = vllm_config.model_config
    _, files, use_safetensors, _ = loader._prepare_weights(
        model_config.model,
        None,
        model_config.revision,
        getattr(model, "fall_back_to_pt_during_load", True),
        getattr(model, "allow_patterns_overrides", None),
    )
    if not use_safetensors:
        raise ValueError(
            f"sparse_nccl inside vLLM needs a safetensors checkpoint; "
            f"{model_config.model!r} provides {[os.path.basename(f) for f in files]}"
        )
    return sorted(files)


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype | None
    dtype_name: str
    shape: tuple[int, ...]


class CheckpointMirror:
    """A model's checkpoint: header metadata for every tensor, data for touched groups.

    `groups[i]` lists the names of layer group `i`; `group_of[name]` is its
    index. `tensors` holds the full tensors of materialized groups (host
    memory, checkpoint dtype, contiguous); `nbytes` is their size.
    """

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self.files = list(files)
        self._stamps = {f: _stamp(f) for f in self.files}
        self.entries: dict[str, _Entry] = {}
        for path in self.files:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name in self.entries:
                        raise ValueError(
                            f"checkpoint tensor {name!r} is in both "
                            f"{self.entries[name].file} and {path}"
                        )
                    piece = handle.get_slice(name)
                    dtype_name = piece.get_dtype()
                    self.entries[name] = _Entry(
                        path,
                        _safetensors_dtype(dtype_name),
                        dtype_name,
                        tuple(piece.get_shape()),
                    )
        self.groups = layerwise_groups(sorted(self.entries, key=_group_order))
        self.group_of = {name: i for i, names in enumerate(self.groups) for name in names}
        self.tensors: dict[str, torch.Tensor] = {}
        self.owner: MirrorPatcher | None = None  # the patcher whose round is open
        self.held: MirrorPatcher | None = None  # the patcher holding a committed round

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.entries[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, wanted in by_file.items():
            if _stamp(path) != self._stamps[path]:
                raise RuntimeError(
                    f"checkpoint file {path} changed after the sparse patch mirror first "
                    "read it; it no longer holds the weights the model was loaded from"
                )
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in wanted:
                    out[name] = handle.get_tensor(name).contiguous()
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """The mirror's full tensor `name`, reading its whole group on first use."""
        tensor = self.tensors.get(name)
        if tensor is None:
            group = [n for n in self.groups[self.group_of[name]] if n not in self.tensors]
            self.tensors.update(self._read(group))
            tensor = self.tensors[name]
        return tensor

    def group(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of group `index`, in checkpoint order."""
        return [(name, self.tensor(name)) for name in self.groups[index]]

    def log_mismatches(self, model: torch.nn.Module) -> int:
        """Compare 1-D tensors the model holds under a checkpoint name; log and count mismatches."""
        candidates = {
            name: param
            for name, param in model.named_parameters()
            if name in self.entries
            and param.dim() == 1
            and not param.is_meta
            and param.numel() > 0
            and tuple(param.shape) == self.entries[name].shape
        }
        if not candidates:
            return 0
        stored = self._read(list(candidates))
        differ = [
            name
            for name, param in candidates.items()
            if not torch.equal(param.detach().cpu(), stored[name].to(param.dtype))
        ]
        if differ:
            logger.warning(
                "sparse_nccl: %d of %d 1-D checkpoint tensors differ from the model's "
                "(first: %r); if the checkpoint files changed since vLLM loaded them, "
                "sparse patches apply to the wrong base weights",
                len(differ),
                len(candidates),
                differ[0],
            )
        return len(differ)


_MIRRORS: weakref.WeakKeyDictionary[torch.nn.Module, CheckpointMirror] = weakref.WeakKeyDictionary()


def mirror_of(model: torch.nn.Module, vllm_config: Any) -> CheckpointMirror:
    """The model's mirror, created on first use."""
    mirror = _MIRRORS.get(model)
    if mirror is None:
        mirror = CheckpointMirror(checkpoint_files(model, vllm_config))
        mirror.log_mismatches(model)
        _MIRRORS[model] = mirror
    return mirror


_UndoLog = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class _HeldRound:
    """A committed round kept for `revert`: the mirror's undo log, and the reload's
    loader holding its snapshot (None when the round touched no group)."""

    undo: _UndoLog
    loader: Revertible | None


class MirrorPatcher:
    """The `SparsePatcher` (and `Revertible`) for a model inside vLLM; see the module docstring.
    With `cast_values` floating-point values are cast to the checkpoint tensor's dtype."""

    cast_values = False

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.mirror: CheckpointMirror | None = None
        self._undo: _UndoLog | None = None
        self._touched: set[int] = set()
        self._held: _HeldRound | None = None

    def begin(self) -> None:
        mirror = mirror_of(self.model, self.vllm_config)
        stale = mirror.owner
        if stale is not None and stale is not self:
            stale.abort()
        self.mirror = mirror
        self._undo = []
        self._touched = set()
        mirror.owner = self

    def _open(self, what: str) -> CheckpointMirror:
        if self._undo is None or self.mirror is None:
            raise RuntimeError(f"MirrorPatcher.{what} outside a round (begin() first)")
        return self.mirror

    def check(self, patch: Any, where: str) -> None:
        entry = self._open("check").entries.get(patch.name)
        if entry is None:
            raise ValueError(
                f"{where}: the checkpoint the model was loaded from has no tensor "
                f"named {patch.name!r}"
            )
        if tuple(patch.full_shape) != entry.shape:
            raise ValueError(
                f"{where}: full shape {list(patch.full_shape)} differs from the "
                f"checkpoint tensor's shape {list(entry.shape)}"
            )
        if entry.dtype is None:
            raise ValueError(
                f"{where}: values are {patch.values.dtype}, the checkpoint tensor is "
                f"{entry.dtype_name}"
            )
        check_dtype(
            patch.values.dtype, entry.dtype, self.cast_values, where, "the checkpoint tensor"
        )

    @torch.no_grad()
    def apply(self, patch: Any) -> None:
        mirror = self._open("apply")
        assert self._undo is not None
        if mirror.held is not None and mirror.held is not self:
            mirror.held.release()  # its log would restore values this round overwrites
        flat = mirror.tensor(patch.name).view(-1)
        index = patch.indices.to(device=flat.device, dtype=torch.int64)
        old = flat.index_select(0, index)
        self._undo.append((flat, index, old))
        flat.index_copy_(0, index, patch.values.to(flat.device, flat.dtype))
        self._touched.add(mirror.group_of[patch.name])

    def commit(self, keep_undo: bool = False) -> None:
        """Reload the touched groups from the mirror; with `keep_undo`, hold the
        round for `revert` (the reload's snapshot and the undo log)."""
        undo = self._undo
        if undo is None:
            return
        try:
            loader = self._reload(sorted(self._touched), keep_undo) if self._touched else None
        except BaseException:
            _restore(undo)
            raise
        finally:
            self._end()
        if keep_undo:
            self._held = _HeldRound(undo, loader)
            assert self.mirror is not None
            self.mirror.held = self

    def abort(self) -> None:
        if self._undo is None:
            return
        try:
            _restore(self._undo)
        finally:
            self._end()

    def revert(self) -> None:
        """The model serves what it served before the held round; the mirror holds it again."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("MirrorPatcher.revert: no committed round was kept (keep_undo)")
        self._unhold()
        try:
            if held.loader is not None:
                held.loader.revert()
        finally:
            _restore(held.undo)

    def release(self) -> None:
        held, self._held = self._held, None
        self._unhold()
        if held is not None and held.loader is not None:
            held.loader.release()

    def _unhold(self) -> None:
        if self.mirror is not None and self.mirror.held is self:
            self.mirror.held = None

    def _reload(self, groups: list[int], keep_undo: bool) -> Revertible | None:
        """Reload `groups` from the mirror; the loader, kept revertible, if `keep_undo`."""
        mirror = self._open("commit")
        loader = loader_for(self.model, self.vllm_config)
        if keep_undo and not isinstance(loader, Revertible):
            raise TypeError(
                f"sparse_nccl: the model's loader ({type(loader).__name__}) cannot revert a "
                "committed reload, so this round cannot be held for a fleet"
            )
        kept: Revertible | None = None
        loader.partial = True  # type: ignore[attr-defined]  # untouched layers: on purpose
        loader.begin()
        try:
            for index in groups:
                loader.load([(name, t.clone()) for name, t in mirror.group(index)])
            if keep_undo:
                assert isinstance(loader, Revertible)
                loader.commit(keep_undo=True)
                kept = loader
            else:
                loader.commit()
        except BaseException:
            loader.abort()
            raise
        return kept

    def _end(self) -> None:
        self._undo = None
        self._touched = set()
        if self.mirror is not None and self.mirror.owner is self:
            self.mirror.owner = None


@torch.no_grad()
def _restore(undo: _UndoLog) -> None:
    """Write the logged old values back into the mirror, newest first."""
    for flat, index, old in reversed(undo):
        flat.index_copy_(0, index, old)


def vllm_patcher(model: torch.nn.Module, vllm_config: Any) -> MirrorPatcher | None:
    """The `wt_sparse_nccl` patcher provider: a `MirrorPatcher` inside vLLM, else None.

    A model with its own `apply_sparse_patch` is left to `wt_sparse_nccl`'s `MethodPatcher`.
    """
    if not is_vllm_config(vllm_config):
        return None
    if callable(getattr(model, "apply_sparse_patch", None)):
        return None
    return MirrorPatcher(model, vllm_config)
