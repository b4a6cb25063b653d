"""Worker side of `sparse_nccl`: receive patch batches and apply them in place.

A batch is received whole (the header, then every wire group the header
announces; see `wt_sparse_nccl.wire`), then checked whole, and only then
applied: a bad patch anywhere in the batch means nothing of the batch is
written. The checks, in order: the update info describes what the trainer
sent (`declared_mismatch`, naming the field); with `verify`, every member's
bytes match the trainer's digests (naming the patch); every patch fits the
model (range, duplicates, name, shape, dtype). Every receive is sized from
the trainer's header, so each of these refusals leaves the group in step and
the next round works without a new handshake.

Every write is recorded in an undo log opened by `start_weight_update`;
`finish_weight_update` commits it and `abort_weight_update` (run by
`update_weights` on any failure) restores every value the round changed,
earlier batches included. The built-in patchers are also core's `Revertible`:
a commit asked to hold (an all-or-nothing fleet round) keeps its undo log, so
`revert()` restores what the model served before the round and `release()`
drops the log (O(nnz) either way). A start without a group (a restarted
worker, or one whose group a failed round tore down) is refused with core's
`Refusal.NO_CONNECTION` message, and the trainer re-forms the group (`reconnect`).

Patches are in checkpoint coordinates (HF name, full shape). How they reach
the model is a `SparsePatcher`, chosen per round by `patcher_for(model,
vllm_config)`:

1. a provider registered with `register_patcher_provider` (a host that knows
   its model, e.g. one holding processed or sharded tensors), newest first;
2. inside vLLM (`vllm_config` is a `VllmConfig`), `wt_sparse_nccl.vllm_patcher`
   (imported only then);
3. `MethodPatcher` when the model defines `apply_sparse_patch`;
4. `InPlacePatcher`: the model's `named_parameters()` carry the HF names and
   full shapes, and entries are written into them in place.

With `MethodPatcher` and `InPlacePatcher`, start and finish run no layerwise
reload: parameters are patched where they live. A provider's patcher may defer
the model change to `commit` (inside vLLM, `wt_sparse_nccl.vllm_patcher`
reloads the touched layers there). No draft-model updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from weight_transfer.backend import WeightTransferEngine, host_memory_bytes, is_vllm_config
from wt_kits.channel import GroupChannel
from wt_kits.group import StatelessGroup, join_group
from wt_kits.stream import DIGEST_DTYPE, BucketDigests, DigestMismatch, bucket_landed
from wt_sparse_nccl.patch import SparseWeightPatch, check_dtype, check_indices_of
from wt_sparse_nccl.wire import (
    HEADER_WORDS,
    BatchHeader,
    SparseNCCLInitInfo,
    SparseNCCLUpdateInfo,
    WireGroup,
    declared_mismatch,
    digest_plan,
    unpack_group,
    wire_groups,
)

__all__ = [
    "SparsePatcher",
    "InPlacePatcher",
    "MethodPatcher",
    "patcher_for",
    "register_patcher_provider",
    "SparseNCCLWorkerEngine",
]


@runtime_checkable
class SparsePatcher(Protocol):
    """Applies checked patches to one model, transactionally.

    `check` raises `ValueError` (prefixed with `where`) for a patch the model
    cannot take and writes nothing; the engine checks a whole batch before the
    first `apply`. `abort` restores every value applied since `begin` and is
    idempotent. A `commit` that raises has already restored everything the
    round changed; `commit` or `abort` after it is a no-op.

    A patcher that is also core's `Revertible` (`commit(keep_undo=True)`,
    `revert`, `release`; every built-in one is) can hold a commit for an
    all-or-nothing fleet round; the engine refuses the hold for one that is not.
    """

    def begin(self) -> None: ...

    def check(self, patch: SparseWeightPatch, where: str) -> None: ...

    def apply(self, patch: SparseWeightPatch) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class InPlacePatcher:
    """Writes entries into `model.named_parameters()` through a flat view.

    A patch's name must be a parameter's name, its full shape the parameter's
    shape and its values dtype the parameter's dtype (no silent casts); the
    parameter must be contiguous. The undo log holds the old values at the
    patched positions: O(nnz) per round; `commit(keep_undo=True)` keeps it
    for `revert()` until `release()`. With `cast_values` (set by the engine
    from its handshake) floating-point values of another floating dtype are
    cast to the parameter's.
    """

    cast_values = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._params: dict[str, torch.nn.Parameter] = {}
        self._undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def begin(self) -> None:
        self._params = dict(self.model.named_parameters())
        self._undo = []

    def check(self, patch: SparseWeightPatch, where: str) -> None:
        param = self._params.get(patch.name)
        if param is None:
            raise ValueError(f"{where}: the model has no parameter named {patch.name!r}")
        if tuple(param.shape) != tuple(patch.full_shape):
            raise ValueError(
                f"{where}: full shape {list(patch.full_shape)} differs from the "
                f"parameter's shape {list(param.shape)}"
            )
        check_dtype(patch.values.dtype, param.dtype, self.cast_values, where, "the parameter")
        if not param.is_contiguous():
            raise ValueError(
                f"{where}: the parameter is not contiguous; it cannot be patched in place"
            )

    def apply(self, patch: SparseWeightPatch) -> None:
        if self._undo is None:
            raise RuntimeError("InPlacePatcher.apply before begin()")
        flat = self._params[patch.name].detach().view(-1)
        index = patch.indices.to(device=flat.device, dtype=torch.int64)
        with torch.no_grad():
            old = flat.index_select(0, index)
            self._undo.append((flat, index, old))
            flat.index_copy_(0, index, patch.values.to(flat.device, flat.dtype))

    def commit(self, keep_undo: bool = False) -> None:
        undo, self._undo = self._undo, None
        self._kept = undo if keep_undo else None

    def abort(self) -> None:
        undo, self._undo = self._undo, None
        _restore_flat(undo)

    def revert(self) -> None:
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError("InPlacePatcher.revert: no committed round was kept (keep_undo)")
        _restore_flat(kept)

    def release(self) -> None:
        self._kept = None


@torch.no_grad()
def _restore_flat(undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None) -> None:
    """Write the logged old values back, newest first (an entry patched twice ends oldest)."""
    for flat, index, old in reversed(undo or []):
        flat.index_copy_(0, index, old)


class MethodPatcher:
    """Delegates to the model's own patch methods.

    The model defines `apply_sparse_patch(name, indices, values) -> Tensor`,
    which writes the entries and returns the values they replaced (same order,
    same dtype); undo re-applies those. It may define
    `check_sparse_patch(name, full_shape, values_dtype)`, raising `ValueError`
    for a patch it cannot take. `commit(keep_undo=True)` keeps the undo log
    for `revert()` until `release()`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._undo: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
        self._kept: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None

    def begin(self) -> None:
        self._undo = []

    def check(self, patch: SparseWeightPatch, where: str) -> None:
        check = getattr(self.model, "check_sparse_patch", None)
        if check is None:
            return
        try:
            check(patch.name, tuple(patch.full_shape), patch.values.dtype)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def apply(self, patch: SparseWeightPatch) -> None:
        if self._undo is None:
            raise RuntimeError("MethodPatcher.apply before begin()")
        old = self.model.apply_sparse_patch(patch.name, patch.indices, patch.values)  # type: ignore[operator]
        self._undo.append((patch.name, patch.indices, old))

    def commit(self, keep_undo: bool = False) -> None:
        undo, self._undo = self._undo, None
        self._kept = undo if keep_undo else None

    def abort(self) -> None:
        undo, self._undo = self._undo, None
        self._reapply(undo)

    def revert(self) -> None:
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError("MethodPatcher.revert: no committed round was kept (keep_undo)")
        self._reapply(kept)

    def release(self) -> None:
        self._kept = None

    def _reapply(self, undo: list[tuple[str, torch.Tensor, torch.Tensor]] | None) -> None:
        for name, indices, old in reversed(undo or []):
            self.model.apply_sparse_patch(name, indices, old)  # type: ignore[operator]


PatcherProvider = Callable[[torch.nn.Module, Any], "SparsePatcher | None"]
_providers: list[PatcherProvider] = []


def register_patcher_provider(provider: PatcherProvider) -> None:
    """Add `provider(model, vllm_config) -> SparsePatcher | None`, tried newest first."""
    _providers.insert(0, provider)


def patcher_for(model: torch.nn.Module, vllm_config: Any) -> SparsePatcher:
    """The patcher for `model` (see the module doc for the order)."""
    for provider in _providers:
        patcher = provider(model, vllm_config)
        if patcher is not None:
            return patcher
    if is_vllm_config(vllm_config):
        from wt_sparse_nccl.vllm_patcher import vllm_patcher

        found = vllm_patcher(model, vllm_config)
        if found is not None:
            return found
    if callable(getattr(model, "apply_sparse_patch", None)):
        return MethodPatcher(model)
    return InPlacePatcher(model)


class SparseNCCLWorkerEngine(WeightTransferEngine[SparseNCCLInitInfo, SparseNCCLUpdateInfo]):
    """Receives patch batches from trainer rank 0; see the module doc.

    The round's transaction is the model's `SparsePatcher` (`new_transaction`),
    which core's base class begins, commits (holds, reverts, releases) and aborts.
    """

    init_info_cls = SparseNCCLInitInfo
    update_info_cls = SparseNCCLUpdateInfo
    supports_draft_weight_update = False
    supports_adapter_update = False

    def __init__(
        self,
        config: Any,
        vllm_config: Any,
        device: torch.device | str,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: GroupChannel[StatelessGroup] = GroupChannel(
            "sparse_nccl",
            remedy="the trainer re-forms the group at its next round (or run trainer_init)",
        )
        self.verify = False
        self.cast_values = False

    def init_transfer_engine(self, init_info: SparseNCCLInitInfo) -> None:
        self.channel.drop("the last init_weight_transfer_engine failed")
        group = join_group(init_info, self.position, self.device)
        self.verify = init_info.verify
        self.cast_values = init_info.cast_values
        self.channel.connect(group)

    def new_transaction(self) -> SparsePatcher:
        patcher = patcher_for(self.model, self.vllm_config)
        if self.cast_values and hasattr(patcher, "cast_values"):  # the built-in patchers
            patcher.cast_values = True
        return patcher

    def receive_weights(self, update_info: SparseNCCLUpdateInfo) -> None:
        """Receive the whole batch as the trainer's header sizes it, check it whole,
        then apply it (see the module doc for the checks)."""
        patcher = self.transaction
        assert isinstance(patcher, SparsePatcher)
        groups = wire_groups(update_info, aligned=self.verify)
        with self.channel.on_wire("receiving a sparse batch") as group:
            sent, received = self._receive(group)
            device = group.device
        refusal = declared_mismatch(update_info, groups, sent)
        if refusal is not None:
            raise ValueError(
                f"sparse_nccl: {refusal}; the trainer's {sent.nbytes} bytes were drained and "
                "nothing of the batch was applied"
            )
        if self.verify:
            self._check_digests(update_info, groups, received)
        patches = self._patches(update_info, groups, [data for data, _ in received], device)
        where = [f"sparse_nccl: patch {i} ({p.name!r})" for i, p in enumerate(patches)]
        check_indices_of(patches, where)
        for patch, named in zip(patches, where, strict=True):
            patcher.check(patch, named)
        for patch in patches:
            patcher.apply(patch)

    def _receive(
        self, group: StatelessGroup
    ) -> tuple[BatchHeader, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """The header, then every wire group it announces (bytes, and digests under
        verify), each received into a buffer of the size the trainer sends."""
        head = torch.empty(HEADER_WORDS, dtype=torch.int64, device=group.device)
        group.wait(group.broadcast(head, src=0), "the header of a sparse batch")
        sent = BatchHeader.parse(head)
        digest_bytes = sum(16 * members for _, members in sent.groups) if self.verify else 0
        limit = host_memory_bytes() // 2
        if sent.nbytes + digest_bytes > limit:
            raise ValueError(
                f"sparse_nccl: the batch header announces {sent.nbytes + digest_bytes} bytes, "
                f"over the limit of {limit} (half this host's memory); the wire is out of step"
            )
        received: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for k, (nbytes, members) in enumerate(sent.groups):
            data = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
            group.wait(group.broadcast(data, src=0), f"wire group {k} of a sparse batch")
            bucket_landed(k, data)
            digests = None
            if self.verify:
                digests = torch.empty(members, 2, dtype=DIGEST_DTYPE, device=group.device)
                group.wait(group.broadcast(digests, src=0), f"the digests of wire group {k}")
            received.append((data, digests))
        return sent, received

    @staticmethod
    def _check_digests(
        info: SparseNCCLUpdateInfo,
        groups: list[WireGroup],
        received: list[tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """`DigestMismatch` naming the first patch whose bytes differ from the trainer's."""
        digests = BucketDigests(digest_plan(info, groups))
        for k, (data, expected) in enumerate(received):
            assert expected is not None
            try:
                digests.check(k, data, expected)
            except DigestMismatch as e:
                raise DigestMismatch(
                    f"sparse_nccl: verify: the {e.param} arrived different from what the "
                    f"trainer sent (wire group {k} of {len(received)}); nothing of the batch "
                    "was applied",
                    bucket=k,
                    param=e.param,
                ) from e

    @staticmethod
    def _patches(
        info: SparseNCCLUpdateInfo,
        groups: list[WireGroup],
        buffers: list[torch.Tensor],
        device: torch.device,
    ) -> list[SparseWeightPatch]:
        """The batch's patches, their tensors views of the received `buffers`."""
        n = len(info.names)
        tensors: dict[str, list[torch.Tensor | None]] = {
            "indices": [None] * n,
            "values": [None] * n,
        }
        for wire_group, buffer in zip(groups, buffers, strict=True):
            for i, part in zip(wire_group.members, unpack_group(wire_group, buffer), strict=True):
                tensors[wire_group.kind][i] = part
        patches = []
        for i, name in enumerate(info.names):
            indices = tensors["indices"][i]
            values = tensors["values"][i]
            patches.append(
                SparseWeightPatch(
                    name=name,
                    indices=(
                        indices
                        if indices is not None
                        else torch.empty(0, dtype=info.index_dtypes[i], device=device)
                    ),
                    values=(
                        values
                        if values is not None
                        else torch.empty(0, dtype=info.values_dtypes[i], device=device)
                    ),
                    full_shape=tuple(info.shapes[i]),
                )
            )
        return patches

    def shutdown(self) -> None:
        self.channel.close()
