"""`sharded_rdt` with local shards: each trainer rank sends only its own piece, nobody gathers.

Trainer ranks are real trainer engines in this process (loopback transport),
each with a source written as vLLM 0.33 writes one: a cached `metadata` that
declares owners, mesh and placements, and `iter_local()` only (its
`iter_full()` raises, so a gather anywhere fails the test). Local pieces are
cut here with `torch.chunk`, independently of the backend's own layout math.
Every check compares each consumer's parameters bit for bit with a fresh
shard loaded the ordinary way, and the bytes each rank served with its share.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.models import checkpoint
from weight_transfer.base import ParamMeta, Replicate, Shard, WeightSource

pytestmark = pytest.mark.timeout(120)

Layout = Callable[[str, torch.Tensor], tuple[Any, ...]]


def fsdp(name: str, t: torch.Tensor) -> tuple[Any, ...]:
    """FSDP2's layout: every parameter split on dim 0."""
    return (Shard(0),)


def row_parallel(name: str, t: torch.Tensor) -> tuple[Any, ...]:
    """Matrices split on dim 1 (row-parallel), vectors on dim 0."""
    return (Shard(1) if t.dim() > 1 else Shard(0),)


def hsdp_tp(name: str, t: torch.Tensor) -> tuple[Any, ...]:
    """A (2, 2) mesh: matrices split on dim 0 by the outer axis, on dim 1 by the
    inner; vectors split by the outer axis, replicated on the inner."""
    return (Shard(0), Shard(1)) if t.dim() > 1 else (Shard(0), Replicate())


def local_piece(
    t: torch.Tensor, placements: tuple[Any, ...], coords: list[int], mesh: tuple[int, ...]
) -> torch.Tensor:
    """What a DTensor holds at mesh coordinates `coords`: `torch.chunk` per mesh axis."""
    for placement, coord, ways in zip(placements, coords, mesh, strict=True):
        if isinstance(placement, Shard):
            chunks = t.chunk(ways, placement.dim)
            t = chunks[coord] if coord < len(chunks) else t.narrow(placement.dim, 0, 0)
    return t.contiguous()


class ShardSource(WeightSource):
    """Rank `rank` of a trainer whose mesh is `mesh_shape` over ranks `0..n-1`."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], rank: int, mesh: tuple[int, ...], layout: Layout
    ) -> None:
        self.tensors, self.rank, self.mesh, self.layout = tensors, rank, mesh, layout

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
        owners = tuple(range(int(torch.tensor(self.mesh).prod())))
        return [
            ParamMeta(
                n,
                t.dtype,
                tuple(t.shape),
                owners=owners,
                mesh_shape=self.mesh,
                placements=self.layout(n, t),
            )
            for n, t in self.tensors.items()
        ]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("the trainer gathered: iter_full() ran")

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        coords, index = [], self.rank
        for ways in reversed(self.mesh):
            coords.append(index % ways)
            index //= ways
        for meta in self.metadata:
            placements = meta.placements or (Replicate(),) * len(self.mesh)
            yield (
                meta.name,
                local_piece(self.tensors[meta.name], placements, coords[::-1], self.mesh),
            )


CASES = {
    "fsdp2-dim0-2ranks": ((2,), fsdp),
    "fsdp2-dim0-3ranks-uneven": ((3,), fsdp),
    "dim1-4ranks": ((4,), row_parallel),
    "2x2-mesh-with-a-replicated-axis": ((2, 2), hsdp_tp),
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_sends_its_own_shard_bit_exactly(shards: Any, case: str, tp: int) -> None:
    mesh, layout = CASES[case]
    ranks = int(torch.tensor(mesh).prod())
    s = shards(tp)
    sources = [ShardSource(checkpoint(1), r, mesh, layout) for r in range(ranks)]
    engines = [
        s.trainer(sources[r], rank=r, client=object(), num_trainer_ranks=ranks)
        for r in range(ranks - 1, 0, -1)
    ]
    engines.insert(0, s.trainer(sources[0], rank=0, num_trainer_ranks=ranks))
    assert all(e.local for e in engines)
    try:
        for seed in (2, 3):
            for source in sources:
                source.tensors = checkpoint(seed)
            others = [threading.Thread(target=e.send_weights) for e in engines[1:]]
            for thread in others:
                thread.start()
            engines[0].send_weights()
            for thread in others:
                thread.join(30)
                assert not thread.is_alive()
            s.assert_serving(seed)
        served = [e.host.describe()["served_bytes"] for e in engines]
        kept = sum(m.kept_bytes() for m in s.models)
        assert sum(served) == kept, (served, kept)  # every byte a consumer keeps, moved once
        assert max(served) <= 1.5 * kept / ranks, (served, kept)  # each about its share
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_local_piece_of_the_wrong_shape_is_refused_naming_the_parameter(shards: Any) -> None:
    s = shards(1)
    source = ShardSource(checkpoint(1), 0, (1,), fsdp)
    engine = s.trainer(source, rank=0)
    try:
        engine.send_weights()
        s.assert_serving(1)
        source.tensors = dict(checkpoint(2))
        source.tensors["layers.0.o.weight"] = source.tensors["layers.0.o.weight"][:-1]
        with pytest.raises(ValueError, match=r"layers\.0\.o\.weight"):
            engine.send_weights()
        s.assert_serving(1)
        source.tensors = checkpoint(2)
        engine.send_weights()
        s.assert_serving(2)
    finally:
        engine.shutdown()


def test_local_shards_asked_of_a_source_without_iter_local_is_refused(shards: Any) -> None:
    from tests.sources import DictSource

    with pytest.raises(ValueError, match="local_shards"):
        shards(1).trainer(DictSource(checkpoint(1)), rank=0, local_shards=True)


class MisdeclaredSource(ShardSource):
    """`ShardSource` whose `layers.0.o.weight` declares `layout` (`ParamMeta` keywords)
    instead of its own."""

    def __init__(self, *args: Any, layout: dict[str, Any]) -> None:
        super().__init__(*args)
        self.misdeclared = layout

    @functools.cached_property
    def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
        metas = ShardSource.metadata.func(self)  # type: ignore[attr-defined]
        return [
            ParamMeta(m.name, m.dtype, m.shape, **self.misdeclared)
            if m.name == "layers.0.o.weight"
            else m
            for m in metas
        ]


@pytest.mark.parametrize(
    ("layout", "field", "says"),
    [
        (
            {"owners": (0, 5), "placements": (Shard(0),)},
            "owners",
            r"rank 5, but the trainer has 2 ranks \(0\.\.1\)",
        ),
        ({"owners": (2, 1), "placements": (Shard(0),)}, "owners", "names trainer rank 2"),
        ({"owners": (0, 5)}, "owners", "names trainer rank 5"),  # replicated on its owners
        ({"owners": (1, 1), "placements": (Shard(0),)}, "owners", "distinct"),
        ({"owners": (0, 1), "mesh_shape": (2, 2)}, "mesh_shape", "does not cover"),
        ({"owners": (0, 1), "mesh_shape": (-1, -2)}, "mesh_shape", "does not cover"),
        ({"owners": (0, 1), "placements": (Shard(0), Shard(1))}, "placements", "2 entries"),
        ({"owners": (0, 1), "placements": (Shard(2),)}, "placements", "shards dim 2"),
    ],
)
def test_an_impossible_layout_is_refused_at_trainer_init_naming_the_parameter(
    shards: Any, layout: dict[str, Any], field: str, says: str
) -> None:
    """Every rank refuses before its producer starts, so no consumer is reached."""
    s = shards(1)
    for rank in (1, 0):
        source = MisdeclaredSource(checkpoint(1), rank, (2,), fsdp, layout=layout)
        with pytest.raises(ValueError) as error:
            s.trainer(source, rank=rank, client=object(), num_trainer_ranks=2)
        text = str(error.value)
        assert text.startswith("parameter 'layers.0.o.weight': field "), text
        assert f"field '{field}'" in text and re.search(says, text), text
    assert all(e.info is None for e in s.engines)


def test_a_worker_refuses_a_handshake_whose_layout_names_a_missing_rank(shards: Any) -> None:
    """Its init fails at the parse, naming the parameter and the field, before any
    producer is asked; the worker keeps serving its weights."""
    s = shards(1)
    engine = s.trainer(ShardSource(checkpoint(1), 0, (1,), fsdp), rank=0)
    try:
        engine.send_weights()
        s.assert_serving(1)
        payload = copy.deepcopy(engine.get_worker_init_payload())
        payload["shard_layouts"]["layers.0.o.weight"] = [[0, 1], [2], [0]]
        with pytest.raises(ValueError) as error:
            s.sessions[0].init_weight_transfer_engine(payload)
        assert str(error.value).startswith(
            "init_info: field 'shard_layouts[layers.0.o.weight]': parameter "
            "'layers.0.o.weight': field 'owners' names trainer rank 1, but the trainer has "
            "1 rank (0..0)"
        ), error.value
        s.assert_serving(1)
    finally:
        engine.shutdown()
