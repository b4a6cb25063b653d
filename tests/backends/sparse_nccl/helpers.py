"""Shared pieces of the `sparse_nccl` tests: patch builders, expected states, a counting client."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weight_transfer import VLLMWeightSyncClient
from weight_transfer.runtime.control import SEAL_FIELD, ControlKey
from wt_sparse_nccl import SparseWeightPatch

MODEL_FACTORY = "tests.backends.sparse_nccl.models:make_model"


class CountingClient:
    """Forwards to `inner` and records every call as `(method, argument)`.

    `rewrite`, when set, replaces every data update on its way (a payload with
    `names`) by `rewrite(payload)`, signed again with `key` (the trainer's,
    `engine.client.control`): an update info that no longer describes what the
    trainer sends, from a control plane that holds the key. A round's seal,
    which carries no weights, is forwarded unrecorded.
    """

    def __init__(self, inner: VLLMWeightSyncClient) -> None:
        self.inner = inner
        self.calls: list[tuple[str, Any]] = []
        self.rewrite: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.key: ControlKey | None = None
        self._lock = threading.Lock()

    def _record(self, method: str, arg: Any) -> None:
        with self._lock:
            self.calls.append((method, arg))

    def methods(self) -> list[str]:
        return [m for m, _ in self.calls]

    def updates(self) -> list[dict[str, Any]]:
        return [a for m, a in self.calls if m == "update_weights"]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._record("init_weight_transfer_engine", init_info)
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._record("start_weight_update", None)
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        if self.rewrite is not None and isinstance(update_info, dict) and "names" in update_info:
            update_info = self.rewrite(update_info)
            if self.key is not None:
                update_info = self.key.sign(update_info)
        if not (isinstance(update_info, dict) and SEAL_FIELD in update_info):
            self._record("update_weights", update_info)
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._record("finish_weight_update", weight_version)
        self.inner.finish_weight_update(weight_version)


def random_patch(
    name: str,
    state: dict[str, torch.Tensor],
    nnz: int,
    gen: torch.Generator,
    *,
    index_dtype: torch.dtype = torch.int64,
    specials: bool = False,
) -> SparseWeightPatch:
    """`nnz` distinct random positions of `state[name]` set to random values of its dtype.

    `specials` puts NaN, -0.0, +inf and -inf first, to check bit-exactness.
    """
    t = state[name]
    indices = torch.randperm(t.numel(), generator=gen)[:nnz].to(index_dtype)
    values = torch.randn(nnz, generator=gen) * 8
    if specials:
        values[:4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    return SparseWeightPatch(name, indices, values.to(t.dtype), tuple(t.shape))


def applied(
    state: dict[str, torch.Tensor], patches: Sequence[SparseWeightPatch]
) -> dict[str, torch.Tensor]:
    """`state` with `patches` applied in order (new tensors; `state` is untouched)."""
    out = {n: t.clone() for n, t in state.items()}
    for p in patches:
        flat = out[p.name].view(-1)
        flat[p.indices.long()] = p.values
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor of `want` is in `got` with the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), name
        assert torch.equal(bits(g), bits(w)), f"{name}: bytes differ"
