"""Core's slice recording: a dry run of a model's loading code, replayed without it."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest
import torch

from weight_transfer import ParamMeta
from weight_transfer.backend import DirectLoader
from weight_transfer.runtime.slices import write_scatters
from wt_kits.slices import UnsupportedOp, apply_chain, record_slices
from wt_kits.stream import aligned_layout


class Loaders(torch.nn.Module):
    """Parameters filled by every allowlisted op a real loader uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(6, 4))
        self.cols = torch.nn.Parameter(torch.zeros(4, 2))
        self.tr = torch.nn.Parameter(torch.zeros(4, 3))
        self.flat = torch.nn.Parameter(torch.zeros(12))
        self.bits = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.int32), requires_grad=False)
        self.rows = torch.nn.Parameter(torch.zeros(2, 4))
        self.pick = torch.nn.Parameter(torch.zeros(4))
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name in ("a", "b"):
                start = 0 if name == "a" else 3
                self.fused.data.narrow(0, start, 3).copy_(w.narrow(0, 1, 3))
            elif name == "c":
                self.cols.data.copy_(w[:, 2:])
            elif name == "d":
                self.tr.data.copy_(w.t())
            elif name == "e":
                self.flat.data.copy_(w.reshape(-1))
            elif name == "f":
                self.bits.data.copy_(w.view(torch.int32))
            elif name == "g":
                first, second = w.chunk(2, dim=0)
                self.rows.data[0].copy_(first[0, ..., ::2])
                self.rows.data[1].copy_(second.unbind(0)[0][1::2])
            elif name == "h":
                self.pick.data.copy_(w[1])
            elif name == "z":
                self.empty.data.copy_(w)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(4, 4, generator=g),
        "b": torch.randn(4, 4, generator=g),
        "c": torch.randn(4, 4, generator=g),
        "d": torch.randn(3, 4, generator=g),
        "e": torch.randn(3, 4, generator=g),
        "f": torch.randn(2, 4, generator=g),
        "g": torch.randn(2, 8, generator=g),
        "h": torch.randn(3, 4, generator=g),
        "z": torch.randn(0, 4, generator=g),
    }


def metas(ts: dict[str, torch.Tensor]) -> list[ParamMeta]:
    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in ts.items()]


def record(model: torch.nn.Module, ts: dict[str, torch.Tensor]) -> dict[str, list]:
    loader = DirectLoader(model)
    with loader.dry_run() as (load, targets):
        return record_slices([metas(ts)], load, targets).scatters


def test_replaying_the_record_equals_loading() -> None:
    ts = tensors(1)
    loaded = Loaders()
    loaded.load_weights(ts.items())
    model = Loaders()
    scatters = record(model, ts)
    assert all(p.abs().sum() == 0 for p in model.parameters()), "the dry run wrote into the model"
    assert set(scatters) == set(ts)
    writes = []
    for name, per_name in scatters.items():
        for s in per_name:
            piece = apply_chain(ts[name], s.key[1]).contiguous()
            assert piece.numel() == s.numel and piece.dtype == s.src_dtype
            writes.append((getattr(model, s.param), s, piece.view(-1)))
    write_scatters(writes)
    for name, want in loaded.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name
    # the pulled bytes are the slices only: "a" keeps 3 of its 4 rows, "c" half its columns
    assert sum(s.nbytes for s in scatters["a"]) == 3 * 4 * 4
    assert sum(s.nbytes for s in scatters["c"]) == 4 * 2 * 4


def test_chains_are_plain_values_that_survive_json() -> None:
    scatters = record(Loaders(), tensors(1))
    ts = tensors(2)
    for name, per_name in scatters.items():
        for s in per_name:
            hash(s.key)
            wire = json.loads(json.dumps(s.key[1]))
            assert torch.equal(apply_chain(ts[name], wire), apply_chain(ts[name], s.key[1]))


class Bad(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = torch.nn.Parameter(torch.zeros(4, 4))
        self.scratch = torch.zeros(4, 4)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            if self.how == "to":
                self.w.data.copy_(w.to(torch.float64))
            elif self.how == "arith":
                self.w.data.copy_(w * 2)
            elif self.how == "mask":
                self.w.data.copy_(w[w > 0])
            elif self.how == "index":
                self.w.data.copy_(w[torch.tensor([0, 1, 2, 3])])
            elif self.how == "item":
                w.sum().item()
            elif self.how == "broadcast":
                self.w.data.copy_(w[0])
            elif self.how == "scratch":
                self.scratch.copy_(w)
            elif self.how == "assign":
                self.w.data = w


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("to", "to is not a slice op"),
        ("arith", "mul is not a slice op"),
        ("mask", "gt is not a slice op"),
        ("index", "tensor argument"),
        ("item", "sum is not a slice op"),
        ("broadcast", "broadcasting copy"),
        ("scratch", "not one of the model's parameters"),
        ("assign", "failed on recording tensors"),
    ],
)
def test_ops_outside_the_allowlist_are_refused_naming_weight_and_op(how: str, says: str) -> None:
    with pytest.raises(UnsupportedOp) as refused:
        record(Bad(how), {"w.weight": torch.zeros(4, 4)})
    assert "'w.weight'" in str(refused.value)
    assert says in str(refused.value)


def test_a_replayed_chain_runs_only_allowlisted_ops() -> None:
    t = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="'fill_' is not an allowed slice op"):
        apply_chain(t, [("fill_", (1,), ())])
    with pytest.raises(ValueError, match="not an op argument"):
        apply_chain(t, [("narrow", ({"x": 1}, 0, 1), ())])
    with pytest.raises(ValueError, match="outputs of a multi-output op"):
        apply_chain(t, [("chunk", (2,), ())])


def test_aligned_layout() -> None:
    offsets, total = aligned_layout([3, 0, 70, 0])
    assert offsets == [0, 64, 64, 192]
    assert total == 192
    assert aligned_layout([]) == ([], 0)
    with pytest.raises(ValueError):
        aligned_layout([-1])
