"""`WeightSource` defaults, `ModuleSource` on a plain module, `checked_iteration`."""

from __future__ import annotations

import re

import pytest
import torch

from tests.core.helpers import ListSource
from tests.harness import digest
from weight_transfer import ModuleSource, ParamMeta
from weight_transfer.source import checked_iteration

F32 = torch.float32

METAS = [
    ParamMeta("model.embed.weight", F32, (4, 2)),
    ParamMeta("model.layers.0.a", F32, (2,)),
    ParamMeta("model.layers.0.b", torch.bfloat16, (3,)),
    ParamMeta("model.layers.1.a", F32, (2,)),
    ParamMeta("model.layers.1.b", torch.bfloat16, (3,)),
    ParamMeta("model.norm.weight", F32, (2,)),
    ParamMeta("lm_head.weight", F32, (4, 2)),
]
NAMES = [m.name for m in METAS]


def test_param_meta_sizes() -> None:
    m = ParamMeta("x", torch.bfloat16, (3, 5))
    assert (m.numel, m.nbytes) == (15, 30)
    assert ParamMeta("s", torch.int64, ()).nbytes == 8
    assert ParamMeta("z", F32, (0, 7)).nbytes == 0


def test_held_names_defaults_to_none_and_groups_to_layerwise() -> None:
    src = ListSource(METAS)
    assert src.held_names() is None
    assert src.groups() == [
        ["model.embed.weight"],
        ["model.layers.0.a", "model.layers.0.b"],
        ["model.layers.1.a", "model.layers.1.b"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_groups_with_partial_ownership_skip_groups_with_nothing_held() -> None:
    # this rank holds layer 1 (one of its names) and the head, nothing else
    src = ListSource(METAS, held={"model.layers.1.b", "lm_head.weight"})
    assert src.groups() == [
        ["model.layers.1.a", "model.layers.1.b"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_iter_groups_batches_one_group_at_a_time() -> None:
    pairs = [(m.name, torch.full(m.shape, float(i), dtype=m.dtype)) for i, m in enumerate(METAS)]
    src = ListSource(METAS, pairs)
    batches = list(src.iter_groups())
    assert [names for names, _ in batches] == src.groups()
    flat = [t for _, ts in batches for t in ts]
    assert [digest(t) for t in flat if t is not None] == [digest(t) for _, t in pairs]


def test_iter_groups_partial_ownership_drops_skipped_groups_and_keeps_none() -> None:
    held = {"model.layers.1.b", "lm_head.weight"}
    src = ListSource(METAS, held=held)
    batches = list(src.iter_groups())
    assert [names for names, _ in batches] == [
        ["model.layers.1.a", "model.layers.1.b"],
        ["model.norm.weight", "lm_head.weight"],
    ]
    # names of a kept group this rank does not hold arrive as None
    assert [[t is None for t in ts] for _, ts in batches] == [[True, False], [True, False]]


def test_iter_groups_raises_naming_the_first_out_of_order_name() -> None:
    pairs = [(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in METAS]
    pairs[1], pairs[3] = pairs[3], pairs[1]  # layer 1's `a` arrives where layer 0's is due
    src = ListSource(METAS, pairs)
    it = src.iter_groups()
    assert next(it)[0] == ["model.embed.weight"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.a' arrived") as err:
        next(it)
    assert "'model.layers.0.a'" in str(err.value)


def test_iter_groups_raises_when_iteration_ends_early() -> None:
    pairs = [(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in METAS[:-1]]
    with pytest.raises(ValueError, match=r"ended before 'lm_head\.weight'"):
        list(ListSource(METAS, pairs).iter_groups())


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    m[1].to(torch.bfloat16)
    return m


def test_module_source_is_reiterable_and_agrees_with_metadata() -> None:
    model = _model()
    src = ModuleSource(model)
    metas = src.metadata()
    assert metas == [
        ParamMeta("0.weight", F32, (4, 3)),
        ParamMeta("0.bias", F32, (4,)),
        ParamMeta("1.weight", torch.bfloat16, (2, 4)),
        ParamMeta("1.bias", torch.bfloat16, (2,)),
    ]
    first = [(n, digest(t)) for n, t in src]
    second = [(n, digest(t)) for n, t in src]
    assert first == second == [(n, digest(p)) for n, p in model.named_parameters()]
    assert [(m, t.requires_grad) for m, t in checked_iteration(metas, src)] == [
        (m, False) for m in metas
    ]
    # a fresh pass sees changes made between passes
    with torch.no_grad():
        model[0].bias.add_(1)
    third = dict(src)
    assert digest(third["0.bias"]) == digest(model[0].bias)
    assert digest(third["0.bias"]) != dict(first)["0.bias"]


def _pairs() -> list[tuple[str, torch.Tensor | None]]:
    return [(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in METAS]


def _divergent(kind: str) -> list[tuple[str, torch.Tensor | None]]:
    pairs = _pairs()
    if kind == "reordered":
        pairs[1], pairs[2] = pairs[2], pairs[1]
    elif kind == "re-dtyped":
        pairs[2] = (pairs[2][0], torch.zeros(3, dtype=torch.float16))
    elif kind == "reshaped":
        pairs[2] = (pairs[2][0], torch.zeros(1, 3, dtype=torch.bfloat16))
    elif kind == "missing":
        del pairs[-1]
    elif kind == "extra":
        pairs.append(("rogue.weight", torch.zeros(1)))
    elif kind == "none":
        pairs[2] = (pairs[2][0], None)
    return pairs


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "reordered",
            [r"parameter #1", r"'model\.layers\.0\.b' \(bfloat16", r"'model\.layers\.0\.a'"],
        ),
        (
            "re-dtyped",
            [r"'model\.layers\.0\.b' \(float16, shape \[3\]\)", r"bfloat16, shape \[3\]"],
        ),
        ("reshaped", [r"'model\.layers\.0\.b' \(bfloat16, shape \[1, 3\]\)", r"shape \[3\]"]),
        ("missing", [r"stopped after 6 parameters", r"declares 7", r"'lm_head\.weight'"]),
        ("extra", [r"'rogue\.weight' after all 7"]),
        ("none", [r"None for 'model\.layers\.0\.b'"]),
    ],
)
def test_checked_iteration_names_the_divergent_parameter(kind: str, expected: list[str]) -> None:
    seen: list[str] = []
    with pytest.raises(ValueError) as err:
        for meta, _ in checked_iteration(METAS, _divergent(kind)):
            seen.append(meta.name)
    for pattern in expected:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))
    # nothing from the divergence on was handed out
    stop = {"reordered": 1, "re-dtyped": 2, "reshaped": 2, "none": 2}.get(kind)
    if stop is not None:
        assert seen == NAMES[:stop]


def test_checked_iteration_passes_matching_pairs_through() -> None:
    pairs = _pairs()
    out = list(checked_iteration(METAS, pairs))
    assert [m for m, _ in out] == METAS
    assert all(t is p for (_, t), (_, p) in zip(out, pairs, strict=True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_non_finite_names_the_first_bad_tensor_across_dtypes(bad: float) -> None:
    """One batched flag per call; the index is the first bad tensor in the caller's
    order, whatever the dtypes' order; a float16 tensor whose norm overflows its
    dtype but whose values are finite is not refused."""
    from weight_transfer.runtime.finite import first_non_finite

    tensors = [
        torch.ones(8, dtype=torch.bfloat16),
        torch.full((70_000,), 300.0, dtype=torch.float16),  # norm ~79,000 > float16's max
        torch.arange(6, dtype=torch.int64),  # not floating: never checked
        torch.zeros(0),
        torch.ones(3, 3, dtype=torch.float64),
        torch.ones(5, dtype=torch.float32),
    ]
    assert first_non_finite(tensors) is None
    tensors[5][2] = bad
    assert first_non_finite(tensors) == 5
    tensors[4][1, 1] = bad  # an earlier one, of another dtype
    assert first_non_finite(tensors) == 4
    tensors[1][69_999] = bad
    assert first_non_finite(tensors) == 1
