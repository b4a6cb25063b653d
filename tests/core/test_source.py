"""`WeightSource` defaults, `ModuleSource`, `checked_iteration`, and vLLM 0.33's way of
writing a source (`ParamMeta` layouts, `source_view`, `local_box`)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.core.helpers import ListSource
from tests.harness import digest
from weight_transfer import ModuleSource, ParamMeta
from weight_transfer.base import Replicate, Shard, WeightSource
from weight_transfer.runtime.sources import local_box, source_view
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


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_first_non_finite_checks_every_float8_encoding(dtype: torch.dtype) -> None:
    """Each of the 256 bit patterns is refused iff it is NaN or infinite (as float32),
    in one call over tensors of several dtypes, named by the first bad index."""
    from weight_transfer.runtime.finite import first_non_finite

    codes = torch.arange(256, dtype=torch.uint8)
    bad = ~codes.view(dtype).float().isfinite()
    assert bad.sum() == (8 if dtype == torch.float8_e5m2 else 2)  # e5m2: 2 infinities, 6 NaN
    finite = codes[~bad].view(dtype)
    for code in range(256):
        one = codes[code : code + 1].view(dtype)
        tensors = [finite, torch.ones(2), one.reshape(1, 1).expand(3, 2), one.new_empty(0)]
        assert first_non_finite(tensors) == (2 if bad[code] else None), code
        tensors[0] = one
        assert first_non_finite(tensors) == (0 if bad[code] else None), code


# -- vLLM 0.33's way of writing a source ---------------------------------------------
@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"mesh_shape": (2,)}, "owners"),
        ({"owners": ()}, "owners"),
        ({"owners": (0, 0)}, "owners"),
        ({"owners": (-1,)}, "owners"),
        ({"owners": (0, 1, 2), "mesh_shape": (2, 2)}, "mesh_shape"),
        ({"owners": (0, 1), "placements": (Shard(0), Shard(1))}, "placements"),
        ({"owners": (0, 1), "placements": (Shard(2),)}, "placements"),
        ({"owners": (0, 1), "placements": ("shard",)}, "placements"),
    ],
)
def test_param_meta_layout_errors_name_the_parameter_and_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError) as error:
        ParamMeta("model.w", F32, (4, 6), **kw)
    assert "'model.w'" in str(error.value) and f"'{field}'" in str(error.value), error.value


def test_param_meta_layout_defaults() -> None:
    m = ParamMeta("w", F32, [4, 6], owners=[3, 1])  # type: ignore[arg-type]
    assert (m.shape, m.owners, m.mesh_shape, m.placements) == ((4, 6), (3, 1), (2,), None)
    assert ParamMeta("w", F32, (4,), owners=(0, 1), placements=(Replicate(),)).placements is None
    assert m.owned_by(1) and not m.owned_by(0) and ParamMeta("v", F32, (2,)).owned_by(7)


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((7, 5), (3,), (Shard(0),)),
        ((2, 9), (4,), (Shard(1),)),  # more ranks than rows: empty pieces
        ((6, 10), (2, 3), (Shard(0), Shard(1))),
        ((6, 10), (2, 2), (Shard(1), Shard(1))),  # both axes split dim 1, outer first
        ((5, 4), (2, 2), (Replicate(), Shard(0))),
    ],
)
def test_local_box_is_where_torch_chunk_puts_each_ranks_piece(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple
) -> None:
    full = torch.arange(math.prod(shape)).reshape(shape)
    owners = tuple(range(10, 10 + math.prod(mesh)))  # any ranks, in mesh order
    meta = ParamMeta("w", torch.int64, shape, owners=owners, mesh_shape=mesh, placements=placements)
    for index, rank in enumerate(owners):
        coords = [index // mesh[1], index % mesh[1]] if len(mesh) == 2 else [index]
        want = full
        for placement, coord, ways in zip(placements, coords, mesh, strict=True):
            if isinstance(placement, Shard):
                chunks = want.chunk(ways, placement.dim)
                want = chunks[coord] if coord < len(chunks) else want.narrow(placement.dim, 0, 0)
        got = full
        for d, (start, length) in enumerate(local_box(meta, rank)):
            got = got.narrow(d, start, length)
        assert torch.equal(got, want), (rank, local_box(meta, rank))
    with pytest.raises(ValueError, match="rank 0 is not one of its owners"):
        local_box(meta, 0)


class Cached033(WeightSource):
    """vLLM 0.33's way: a cached `metadata` declaring owners, `iter_full` of what this rank owns."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tensors = {m.name: torch.full(m.shape, float(i)) for i, m in enumerate(METAS)}

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
        return [
            ParamMeta(m.name, F32, m.shape, owners=(0,) if "layers.1" in m.name else (0, 1))
            for m in METAS
        ]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.owned_names(self.rank):
            yield name, self.tensors[name]


class Hybrid(WeightSource):
    def metadata(self) -> list[ParamMeta]:
        return METAS

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for m in METAS:
            yield m.name, torch.zeros(m.shape, dtype=m.dtype)


def test_a_vllm_033_source_is_seen_the_specs_way() -> None:
    for rank in (0, 1):
        source = Cached033(rank)
        view = source_view(source, rank)
        assert view is not source and view.metadata() == source.metadata
        owned = [m.name for m in source.metadata if m.owned_by(rank)]
        assert view.held_names() == set(owned)
        pairs = [pair for names, got in view.iter_groups() for pair in zip(names, got, strict=True)]
        assert [n for n, t in pairs if t is not None] == owned
        assert all(torch.equal(t, source.tensors[n]) for n, t in pairs if t is not None)
        assert view.implements_iter_full() and not view.implements_iter_local()
    spec = ListSource(METAS)
    assert source_view(spec, 0) is spec
    hybrid = Hybrid()  # a method `metadata()`, but `iter_full` instead of `__iter__`
    view = source_view(hybrid, 0)
    assert view is not hybrid and [n for n, _ in view] == NAMES
    assert spec.owned_names(0) == NAMES and spec.implements_iter_full()
    assert [n for n, _ in spec.iter_full()] == NAMES


def test_a_vllm_033_source_that_strays_is_named() -> None:
    source = Cached033(0)
    source.tensors["model.layers.0.b"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.b"):
        list(checked_iteration(source.metadata, source_view(source, 0)))


def _declared_by_module_source(store: str) -> tuple[Any, ...]:
    """In a process of its own (the test process may hold a default group already):
    a one-rank gloo group, a Linear whose weight is a DTensor sharded on dim 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 3)
        full = model.weight.detach().clone()
        model.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [TorchShard(1)]))
        source = ModuleSource(model)
        weight, bias = source.metadata()
        local = dict(source.iter_local())
        return (
            (weight.owners, weight.mesh_shape, weight.placements),
            (bias.owners, bias.placements),
            source.implements_iter_local(),
            source.held_names(),
            torch.equal(local["weight"], full) and torch.equal(local["bias"], model.bias),
        )
    finally:
        dist.destroy_process_group()


def test_module_source_declares_dtensor_owners_and_placements(tmp_path: Any) -> None:
    """A DTensor parameter is declared with its mesh's ranks and placements and
    iter_local yields its local tensor; a plain one is every rank's."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        declared = pool.apply(_declared_by_module_source, (str(tmp_path / "store"),))
    assert declared == (((0,), (1,), (Shard(1),)), (None, None), True, None, True)


def test_metadata_from_triplets_as_trl_and_vllm_write_them() -> None:
    from weight_transfer import StreamedSource, param_metadata

    metas = param_metadata(
        [("a", "float32", [2, 3]), ("b", "torch.bfloat16", (4,)), ("c", torch.int64, [])]
    )
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        ("a", torch.float32, (2, 3)),
        ("b", torch.bfloat16, (4,)),
        ("c", torch.int64, ()),
    ]
    for bad, field in [
        (("a", "float33", [1]), "metadata[0] ('a'): dtype"),
        (("a", "float32", [1, -1]), "field 'shape'"),
        (("", "float32", [1]), "field 'name'"),
        (("a", "float32"), "not a (name, dtype, shape)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(field)):
            param_metadata([bad])
    source = StreamedSource([("a", "float32", [2])], iter([("a", torch.ones(2))]))
    assert [m.name for m in source.metadata()] == ["a"]
    assert [n for n, _ in source] == ["a"]
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(source)


def test_a_trainer_device_may_be_a_string_a_torch_device_or_a_cuda_index() -> None:
    from wt_ipc import IPCTrainerInitInfo
    from wt_nccl import NCCLTrainerInitInfo

    for given, kept in [("cpu", "cpu"), (torch.device("cpu"), "cpu"), (1, "cuda:1"), (None, None)]:
        info = NCCLTrainerInitInfo("127.0.0.1", 1234, 2, rank=0, device=given)
        assert info.device == kept
        assert IPCTrainerInitInfo(rank=0, device=given).device == kept
    assert NCCLTrainerInitInfo("127.0.0.1", 1234, 2, rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="NCCLTrainerInitInfo: field 'device'"):
        NCCLTrainerInitInfo("127.0.0.1", 1234, 2, rank=0, device=3.5)  # type: ignore[arg-type]
