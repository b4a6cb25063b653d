"""`sparse_nccl` pieces in one process: update-info parsing, the wire layout, the patchers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.sparse_nccl.helpers import applied, assert_same_bits, random_patch
from tests.backends.sparse_nccl.models import MethodModel, initial_state, make_model
from weight_transfer import WeightTransferConfig, WorkerSession
from weight_transfer.backend import Revertible
from wt_sparse_nccl import (
    InPlacePatcher,
    MethodPatcher,
    SparseNCCLUpdateInfo,
    SparseNCCLWorkerEngine,
    SparseWeightPatch,
    patcher_for,
    register_patcher_provider,
)
from wt_sparse_nccl import worker as worker_module
from wt_sparse_nccl.wire import wire_groups


def engine_for(model: torch.nn.Module) -> SparseNCCLWorkerEngine:
    return SparseNCCLWorkerEngine(WeightTransferConfig("sparse_nccl"), None, "cpu", model)


def good_update() -> dict[str, Any]:
    return {
        "names": ["a", "b", "c"],
        "dtype_names": ["float32", "bfloat16", "float32"],
        "index_dtype_names": ["int32", "int64", "int32"],
        "shapes": [[4, 4], [10], [3]],
        "num_updates": [3, 0, 2],
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype_names": ["float32"]}, "field 'dtype_names' has 1 entries, 'names' has 3"),
        ({"shapes": [[4, 4]]}, "field 'shapes' has 1 entries"),
        ({"num_updates": [3, -1, 2]}, r"field 'num_updates\[1\]' must be non-negative"),
        ({"index_dtype_names": ["int32", "int16", "int32"]}, r"'index_dtype_names\[1\]' must be"),
        ({"dtype_names": ["float32", "Tensor", "float32"]}, r"'dtype_names\[1\]': unknown dtype"),
        ({"shapes": [[4, -4], [10], [3]]}, r"field 'shapes\[0\]' has a negative dimension"),
        ({"names": ["a", "", "c"]}, r"field 'names\[1\]' must not be empty"),
        (
            {k: [] for k in good_update()},
            "field 'names' must list at least one patch",
        ),
        ({"num_updates": [3, "x", 2]}, r"field 'num_updates\[1\]': expected int"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_update_info_is_checked_at_parse_time(change: dict[str, Any], message: str) -> None:
    engine = engine_for(make_model())
    engine.parse_update_info(good_update())
    with pytest.raises(ValueError, match=rf"update_info: .*{message}"):
        engine.parse_update_info({**good_update(), **change})


def test_wire_groups_put_indices_then_values_one_group_per_dtype() -> None:
    info = SparseNCCLUpdateInfo(**good_update())
    layout = [(g.kind, g.dtype, g.members, g.counts) for g in wire_groups(info)]
    assert layout == [
        ("indices", torch.int32, (0, 2), (3, 2)),
        ("values", torch.float32, (0, 2), (3, 2)),
    ]  # the int64 index and bfloat16 value groups hold nothing and are not sent


def test_in_place_patcher_writes_in_place_and_abort_restores_every_bit() -> None:
    model = make_model()
    state = initial_state()
    g = torch.Generator().manual_seed(3)
    name = "layers.0.weight"
    first = random_patch(name, state, 40, g, index_dtype=torch.int32, specials=True)
    second = random_patch(name, state, 40, g)  # overlaps `first` almost surely
    assert set(first.indices.tolist()) & set(second.indices.tolist())
    storage = model.layers[0].weight.data_ptr()

    patcher = patcher_for(model, None)
    assert isinstance(patcher, InPlacePatcher)
    patcher.begin()
    patcher.apply(first)
    patcher.apply(second)
    now = {n: p.detach() for n, p in model.named_parameters()}
    assert_same_bits(now, applied(state, [first, second]))
    assert model.layers[0].weight.data_ptr() == storage
    patcher.abort()
    assert_same_bits({n: p.detach() for n, p in model.named_parameters()}, state)
    patcher.abort()  # idempotent

    patcher.begin()
    patcher.apply(first)
    patcher.commit()
    patcher.abort()  # nothing left to undo
    assert_same_bits({n: p.detach() for n, p in model.named_parameters()}, applied(state, [first]))


def test_a_held_commit_reverts_every_bit_and_a_released_one_cannot() -> None:
    """The built-in patchers are core's `Revertible`: the undo log outlives a held commit."""
    model = make_model()
    state = initial_state()
    g = torch.Generator().manual_seed(4)
    name = "mixed.bf16_weight"
    first = random_patch(name, state, 30, g, index_dtype=torch.int32, specials=True)
    second = random_patch(name, state, 30, g)  # overlaps `first`: undone newest first

    patcher = patcher_for(model, None)
    assert isinstance(patcher, Revertible)
    patcher.begin()
    patcher.apply(first)
    patcher.apply(second)
    patcher.commit(keep_undo=True)
    patcher.abort()  # a no-op after the commit
    assert_same_bits(dict(model.named_parameters()), applied(state, [first, second]))
    patcher.revert()
    assert_same_bits(dict(model.named_parameters()), state)
    with pytest.raises(RuntimeError, match="no committed round was kept"):
        patcher.revert()

    patcher.begin()
    patcher.apply(first)
    patcher.commit(keep_undo=True)
    patcher.release()
    with pytest.raises(RuntimeError, match="no committed round was kept"):
        patcher.revert()
    assert_same_bits(dict(model.named_parameters()), applied(state, [first]))

    method_model = MethodModel()
    before = method_model.store.clone()
    method = patcher_for(method_model, None)
    assert isinstance(method, Revertible)
    method.begin()
    method.apply(SparseWeightPatch("w", torch.tensor([3, 4]), torch.tensor([9.0, 8.0]), (12,)))
    method.apply(SparseWeightPatch("w", torch.tensor([4]), torch.tensor([7.0]), (12,)))
    method.commit(keep_undo=True)
    assert method_model.store[[3, 4]].tolist() == [9.0, 7.0]
    method.revert()
    assert torch.equal(method_model.store, before)


def test_in_place_patcher_refuses_what_it_cannot_patch() -> None:
    model = make_model()
    patcher = InPlacePatcher(model)
    patcher.begin()
    for patch, message in [
        (SparseWeightPatch("nope", torch.tensor([0]), torch.ones(1), (1,)), "no parameter"),
        (SparseWeightPatch("layers.0.bias", torch.tensor([0]), torch.ones(1), (13,)), "shape"),
        (
            SparseWeightPatch("layers.0.bias", torch.tensor([0]), torch.ones(1).half(), (12,)),
            "torch.float16, the parameter is torch.float32",
        ),
    ]:
        with pytest.raises(ValueError, match=f"where: .*{message}"):
            patcher.check(patch, "where")
    model.layers[0].weight.data = model.layers[0].weight.data.t()
    patcher.begin()
    with pytest.raises(ValueError, match="not contiguous"):
        patcher.check(
            SparseWeightPatch("layers.0.weight", torch.tensor([0]), torch.ones(1), (16, 12)), "w"
        )


def test_method_patcher_uses_the_models_methods_and_undoes_through_them() -> None:
    model = MethodModel()
    before = model.store.clone()
    patcher = patcher_for(model, None)
    assert isinstance(patcher, MethodPatcher)
    patcher.begin()
    with pytest.raises(ValueError, match=r"patch 0 \('v'\): cannot patch 'v'"):
        patcher.check(
            SparseWeightPatch("v", torch.tensor([0]), torch.ones(1), (12,)), "patch 0 ('v')"
        )
    a = SparseWeightPatch(
        "w", torch.tensor([1, 2], dtype=torch.int32), torch.tensor([-1.0, -2.0]), (12,)
    )
    b = SparseWeightPatch("w", torch.tensor([2, 5]), torch.tensor([-3.0, -4.0]), (12,))
    for p in (a, b):
        patcher.check(p, "w")
        patcher.apply(p)
    assert model.store[[1, 2, 5]].tolist() == [-1.0, -3.0, -4.0]
    patcher.abort()
    assert torch.equal(model.store, before)


@pytest.fixture
def no_providers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(worker_module, "_providers", [])
    yield


def test_a_registered_provider_chooses_the_patcher(no_providers: None) -> None:
    chosen = InPlacePatcher(torch.nn.Linear(2, 2))
    seen: list[Any] = []

    def provider(model: torch.nn.Module, vllm_config: Any) -> InPlacePatcher | None:
        seen.append(vllm_config)
        return chosen if isinstance(model, MethodModel) else None

    register_patcher_provider(provider)
    assert patcher_for(MethodModel(), "cfg") is chosen
    assert isinstance(patcher_for(make_model(), "cfg"), InPlacePatcher)
    assert seen == ["cfg", "cfg"]


def test_engine_flags_and_ordering_errors() -> None:
    engine = engine_for(make_model())
    assert not engine.supports_draft_weight_update
    session = WorkerSession(engine, draft_model=make_model())
    with pytest.raises(RuntimeError, match="does not support draft"):
        session.start_draft_weight_update()
    with pytest.raises(RuntimeError, match=r"no transfer group \(it has not been connected yet\)"):
        session.start_weight_update()  # Refusal.NO_CONNECTION: the trainer re-admits
    assert not session.active
    assert_same_bits({n: p.detach() for n, p in engine.model.named_parameters()}, initial_state())
