"""`sharded_rdt`'s pure pieces: handshake validation, plans, routing, the producer's rules."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.models import ShardedModel, checkpoint
from weight_transfer import ParamMeta, layerwise_groups
from weight_transfer.backend import DirectLoader, payload_of
from weight_transfer.base import Shard
from wt_kits.slices import Scatter
from wt_kits.stream import digest
from wt_sharded_rdt.producer import Producer, ProducerError
from wt_sharded_rdt.protocol import (
    Router,
    ShardedRDTUpdateInfo,
    ShardedRDTWorkerInitInfo,
    blob_layout,
    build_plan,
    digests_view,
    metadata_digest,
    owner_table,
)
from wt_sharded_rdt.shards import SliceBox, shard_pieces, slice_box
from wt_sharded_rdt.trainer import ShardedRDTTrainerInitInfo
from wt_sharded_rdt.worker import bake


def handshake(**kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        transport="loopback",
        producer_names=["p0", "p1"],
        names=["a.w", "b.w"],
        dtype_names=["float32", "bfloat16"],
        shapes=[[2, 2], [3]],
        group_lens=[1, 1],
        owner_sets=[[0], [0, 1]],
        name_owner_class=[0, 1],
        num_consumers=4,
        workers_per_replica=2,
        replica_rank=1,
    )
    fields.update(kw)
    return fields


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"group_lens": [1]}, "group_lens"),
        ({"owner_sets": [[0], [2]]}, "owner_sets[1]"),
        ({"owner_sets": [[1, 0], [0]]}, "owner_sets[0]"),
        ({"name_owner_class": [0]}, "name_owner_class"),
        ({"name_owner_class": [0, 5]}, "name_owner_class[1]"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"replica_rank": 2}, "replica_rank"),
        ({"workers_per_replica": 5}, "workers_per_replica"),
        ({"producer_names": []}, "producer_names"),
        ({"dtype_names": ["float32", "complex64"]}, "dtype_names[1]"),
        ({"shapes": [[2, -2], [3]]}, "shapes[0]"),
        ({"num_rdt_buffers": 0}, "num_rdt_buffers"),
        ({"stall_timeout_s": 0}, "stall_timeout_s"),
        ({"shard_layouts": {"c.w": [[0], [1], [0]]}}, "shard_layouts"),
        ({"shard_layouts": {"a.w": [[0, 0], [2], [0]]}}, "shard_layouts[a.w]"),
        ({"shard_layouts": {"a.w": [[0, 1], [2], [5]]}}, "shard_layouts[a.w]"),
        ({"shard_layouts": {"a.w": [[0, 1]]}}, "shard_layouts[a.w]"),
    ],
)
def test_malformed_handshake_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(
        ValueError, match=f"field '{field}'".replace("[", r"\[").replace("]", r"\]")
    ):
        ShardedRDTWorkerInitInfo(**handshake(**change))


@pytest.mark.parametrize(
    ("layout", "field", "says"),
    [
        (
            [[0, 2], [2], [0]],
            "owners",
            r"names trainer rank 2, but the trainer has 2 ranks \(0\.\.1\)",
        ),
        ([[7], [1], [1]], "owners", "names trainer rank 7"),
        ([[1, 1], [2], [0]], "owners", "distinct"),
        ([[0, -1], [2], [0]], "owners", "non-negative"),
        ([[0, 1], [3], [0]], "mesh_shape", "does not cover"),
        ([[0, 1], [-1, -2], [0, 0]], "mesh_shape", "does not cover"),
        ([[0, 1], [2], [0, 1]], "placements", "2 entries for a 1-D mesh"),
        ([[0, 1], [2], [2]], "placements", "shards dim 2 of a 2-D tensor"),
        ([[0, 1], [2], [-2]], "placements", "holds -2"),
    ],
)
def test_a_handshake_with_an_impossible_layout_names_the_parameter_and_field(
    layout: list[list[int]], field: str, says: str
) -> None:
    """The consumer's parse refuses it (ValueError, never an IndexError or KeyError
    later): its two producers are trainer ranks 0 and 1."""
    with pytest.raises(ValueError) as error:
        ShardedRDTWorkerInitInfo(**handshake(shard_layouts={"a.w": layout}))
    text = str(error.value)
    assert text.startswith(
        f"init_info: field 'shard_layouts[a.w]': parameter 'a.w': field '{field}'"
    )
    assert re.search(says, text), text


def test_a_handshake_whose_shard_layouts_is_no_mapping_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"field 'shard_layouts' must map names to layouts"):
        ShardedRDTWorkerInitInfo(**handshake(shard_layouts=[["a.w", [[0], [1], [0]]]]))


def test_handshake_round_trips_as_json() -> None:
    info = ShardedRDTWorkerInitInfo(**handshake())
    again = ShardedRDTWorkerInitInfo(**payload_of(info))
    assert (
        again.metas
        == info.metas
        == [
            ParamMeta("a.w", torch.float32, (2, 2)),
            ParamMeta("b.w", torch.bfloat16, (3,)),
        ]
    )
    assert again.groups() == [["a.w"], ["b.w"]]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_consumers": 3, "num_replicas": 2}, "num_consumers"),
        ({"rank": 2, "num_trainer_ranks": 2}, "rank"),
        ({"gather_lookahead": -1}, "gather_lookahead"),
        ({"transport": "tcp"}, "transport"),
        ({"chunk_bytes": 10}, "chunk_bytes"),
    ],
)
def test_trainer_init_info_names_the_field(kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"rank": 0, "num_consumers": 2, **kw}
    with pytest.raises(ValueError, match=f"field '{field}'"):
        ShardedRDTTrainerInitInfo(**args)


def test_owner_table_is_a_pure_function_and_names_orphans() -> None:
    names = ["a", "b", "c"]
    assert owner_table(names, [[True, True, False], [False, True, True]]) == (
        [[0], [0, 1], [1]],
        [0, 1, 2],
    )
    with pytest.raises(ValueError, match="'b'"):
        owner_table(names, [[True, False, False], [False, False, True]])
    metas = [ParamMeta("a", torch.float32, (2,))]
    assert metadata_digest(metas) != metadata_digest([ParamMeta("a", torch.float32, (3,))])


def recorded(tp_rank: int, tp: int) -> tuple[Any, list[list[str]]]:
    tensors = checkpoint(1)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    groups = layerwise_groups(m.name for m in metas)
    by = {m.name: m for m in metas}
    record, _ = bake(DirectLoader(ShardedModel(tp_rank, tp)), [[by[n] for n in g] for g in groups])
    return record, groups


def test_plan_chunks_by_owner_and_size() -> None:
    record, groups = recorded(0, 2)
    names = [n for g in groups for n in g]
    # the embedding with rank 0 only, everything else with both ranks
    router = Router([[0], [0, 1]], [0 if n == "embed.weight" else 1 for n in names], names)
    plan = build_plan(record, groups, router, consumer_id=1, chunk_bytes=4096)
    assert plan.chunks[0].owner == 0 and plan.chunks[0].keys[0][0] == "embed.weight"
    by_group: dict[int, list[Any]] = {}
    for chunk in plan.chunks:
        by_group.setdefault(chunk.group, []).append(chunk)
        assert chunk.nbytes <= 4096 or len(chunk.keys) == 1
        assert all(o % 64 == 0 for o in chunk.offsets)
    for group, chunks in by_group.items():
        assert [c.frees for c in chunks] == [[]] * (len(chunks) - 1) + [[group]]
        assert len({c.owner for c in chunks}) == 1  # a layer's names share one owner class
    # seq counts each producer's pulls in issue order
    for owner in {c.owner for c in plan.chunks}:
        assert [c.seq for c in plan.chunks if c.owner == owner] == list(
            range(sum(c.owner == owner for c in plan.chunks))
        )
    # each module is materialized before its first chunk and processed after its last
    begins = {m: c.index for c in plan.chunks for m in c.begins}
    ends = {m: c.index for c in plan.chunks for m in c.ends}
    assert begins.keys() == ends.keys() and all(begins[m] <= ends[m] for m in begins)
    # consumers 0 and 1 spread their layers over the two ranks holding them
    other = build_plan(record, groups, router, consumer_id=0, chunk_bytes=4096)
    assert [c.owner for c in other.chunks if c.group == 1] != [
        c.owner for c in plan.chunks if c.group == 1
    ]


def test_a_span_of_groups_is_pulled_in_one_pull_per_producer_and_freed_after_it() -> None:
    record, groups = recorded(1, 2)
    names = [n for g in groups for n in g]
    router = Router([[0], [0, 1]], [0 if n == "embed.weight" else 1 for n in names], names)
    one = build_plan(record, groups, router, consumer_id=1, chunk_bytes=1 << 20)
    needed = [gi for gi in range(len(groups)) if gi not in one.pre_free]
    for span in (2, 3, len(groups)):
        plan = build_plan(record, groups, router, consumer_id=1, chunk_bytes=1 << 20, span=span)
        assert plan.pre_free == one.pre_free

        # the same slices land in the same places, in fewer pulls
        def slices(p: Any) -> list[Any]:
            return sorted(
                (str(k), [str(s) for s in ss])
                for c in p.chunks
                for k, ss in zip(c.keys, c.scatters, strict=True)
            )

        assert slices(plan) == slices(one)
        assert len(plan.chunks) < len(one.chunks)
        group_of = {n: gi for gi, g in enumerate(groups) for n in g}
        freed: list[int] = []
        for chunk in plan.chunks:
            spanned = {group_of[name] for name, _ in chunk.keys}
            # within one window of `span` group indices, none freed yet
            assert len({g // span for g in spanned}) == 1, spanned
            assert not spanned & set(freed)
            freed += chunk.frees
        assert sorted(freed) == needed
        for owner in {c.owner for c in plan.chunks}:  # issue order per producer
            assert [c.seq for c in plan.chunks if c.owner == owner] == list(
                range(sum(c.owner == owner for c in plan.chunks))
            )


def test_the_trainer_keeps_about_its_staging_budget_published() -> None:
    from wt_sharded_rdt.protocol import MAX_LOOKAHEAD, auto_lookahead, pull_span

    assert auto_lookahead([64 << 20] * 16, budget=512 << 20) == 7
    assert auto_lookahead([2 << 20] * 150, budget=512 << 20) == 255  # memory bounds it
    assert auto_lookahead([8] * 150, budget=512 << 20) == MAX_LOOKAHEAD
    assert auto_lookahead([2 << 30], budget=512 << 20) == 1  # a layer over the budget
    assert auto_lookahead([]) == 1
    assert [pull_span(n) for n in (0, 1, 2, 7, 64)] == [1, 1, 1, 4, 32]


def producer(**kw: Any) -> Producer:
    args: dict[str, Any] = dict(
        rank=0,
        served_names=["a"],
        digest="d",
        held=[True],
        num_buffers=2,
        stall_timeout_s=5.0,
        peer_timeout_s=5.0,
    )
    args.update(kw)
    return Producer(**args)


def test_producer_refuses_misrouted_and_stale_pulls() -> None:
    p = producer()
    p.begin_sync(2, [0])
    with pytest.raises(ProducerError, match="does not hold 'b'"):
        p.serve(2, 0, 0, [("b", ())], [("float32", 4)])
    with pytest.raises(ProducerError, match="pulled for sync 1"):
        p.serve(1, 0, 0, [("a", ())], [("float32", 4)])
    with pytest.raises(ValueError, match="'seq'"):
        p.serve(2, 0, -1, [("a", ())], [("float32", 4)])
    p.publish({0: {"a": torch.arange(4, dtype=torch.float32)}})
    with pytest.raises(ProducerError, match=r"'a'.*expects float32 x 3"):
        p.serve(2, 0, 0, [("a", ())], [("float32", 3)])
    blob = p.serve(2, 0, 0, [("a", (("narrow", (0, 1, 2), ()),))], [("float32", 2)])
    assert torch.equal(blob.view(torch.float32), torch.tensor([1.0, 2.0]))


def test_producer_frees_count_per_sync() -> None:
    p = producer()
    p.begin_sync(1, [0, 1])
    p.free(2, 0, [0])  # early: belongs to the next sync
    p.publish({0: {"a": torch.zeros(4)}})
    assert p.free(1, 0, [0]) and p.wait_freed(0.1) == []
    assert p.free(1, 1, [0]) and p.wait_freed(0.1) == [0]
    p.end_sync()
    p.begin_sync(2, [0, 1])
    assert not p.free(1, 1, [0])  # late: credits nothing
    p.publish({0: {"a": torch.zeros(4)}})
    assert p.wait_freed(0.1) == []  # only consumer 0's early free counted
    p.free(2, 1, [0])
    assert p.wait_freed(0.1) == [0]


def test_producer_error_wakes_every_waiter() -> None:
    p = producer()
    p.begin_sync(1, [0])
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            p.serve(1, 0, 0, [("a", ())], [("float32", 4)])
        except BaseException as error:
            errors.append(error)

    waiter = threading.Thread(target=pull)
    waiter.start()
    p.set_error("trainer rank 0 failed")
    waiter.join(5)
    assert not waiter.is_alive()
    assert "trainer rank 0 failed" in str(errors[0])
    with pytest.raises(ProducerError, match="trainer rank 0 failed"):
        p.wait_freed(0.1)


def test_a_verified_blob_carries_the_digest_of_each_slice() -> None:
    """The digest rows after the slices are core's `digest` of each slice's bytes."""
    p = producer(verify=True)
    p.begin_sync(1, [0])
    a = torch.arange(10, dtype=torch.float32) * 1.5
    p.publish({0: {"a": a}})
    keys = [("a", (("narrow", (0, 1, 3), ()),)), ("a", ())]
    blob = p.serve(1, 0, 0, keys, [("float32", 3), ("float32", 10)])
    layout = blob_layout([12, 40], verify=True)
    assert blob.numel() == layout.nbytes and layout.digests_at is not None
    rows = digests_view(blob, layout)
    assert torch.equal(rows[0], digest(a[1:4]))
    assert torch.equal(rows[1], digest(a))
    assert torch.equal(blob[layout.offsets[1] : layout.offsets[1] + 40].view(torch.float32), a)


def test_producer_errors_fail_the_sync_they_name() -> None:
    """An error for a sync not yet begun fails that sync when it begins; a late one
    (an older sync) fails nothing; a consumer that skips a sync it is live in fails it."""
    p = producer()
    p.begin_sync(1, [0, 1])
    p.set_error("consumer 1 refused sync 2", 2)
    p.set_error("a late error of sync 0", 0)
    p.skip(1, 5)  # not live in sync 1: nothing wrong
    assert p.wait_freed(0.05) == []
    p.publish({0: {"a": torch.zeros(4)}})
    p.begin_sync(2, [0, 1])
    with pytest.raises(ProducerError, match="consumer 1 refused sync 2"):
        p.publish({0: {"a": torch.zeros(4)}})
    p.begin_sync(3, [0, 1])
    p.skip(3, 1)
    with pytest.raises(ProducerError, match=r"consumer 1 skipped.*'live_consumers'"):
        p.publish({0: {"a": torch.zeros(4)}})


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"sync_id": 0}, "sync_id"),
        ({"sync_id": 1, "live_consumers": [1, 0]}, "live_consumers"),
        ({"sync_id": 1, "live_consumers": [0, 0]}, "live_consumers"),
        ({"sync_id": 1, "live_consumers": [-1]}, "live_consumers"),
    ],
)
def test_malformed_update_info_names_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"update_info: field '{field}'"):
        ShardedRDTUpdateInfo(**fields)


_ALL = ("__slice__", None, None, None)


@pytest.mark.parametrize(
    ("chain", "box", "dims"),
    [
        ((), ((0, 6), (0, 8)), (0, 1)),
        ((("narrow", (0, 2, 3), ()),), ((2, 3), (0, 8)), (0, 1)),
        ((("t", (), ()),), ((0, 6), (0, 8)), (1, 0)),
        ((("chunk", (2,), (("dim", 1),)), ("__getitem__", (1,), ())), ((0, 6), (4, 4)), (0, 1)),
        ((("__getitem__", (1,), ()), ("unsqueeze", (0,), ())), ((1, 1), (0, 8)), (None, 1)),
        ((("contiguous", (), ()), ("narrow", (1, 3, 2), ())), ((0, 6), (3, 2)), (0, 1)),
        ((("view", ((-1,),), ()),), None, None),  # merges two dims
        ((("__getitem__", ((_ALL, ("__slice__", None, None, 2)),), ()),), None, None),  # a step
        ((("view", (("__dtype__", "float16"),), ()),), None, None),  # reinterprets
    ],
)
def test_a_slice_is_a_box_of_the_tensor_or_none(chain: Any, box: Any, dims: Any) -> None:
    cut = slice_box(ParamMeta("w", torch.float32, (6, 8)), chain)
    assert (cut is None) if box is None else (cut == SliceBox(box, dims)), cut


def test_a_slice_that_is_no_box_of_a_sharded_tensor_is_refused_naming_it() -> None:
    meta = ParamMeta("model.w", torch.float32, (6, 8), owners=(0, 1), placements=(Shard(0),))
    chain = (("view", ((-1,),), ()),)
    scatter = Scatter(("model.w", chain), "m", "weight", 0, (48,), (1,), (48,), torch.float32)
    with pytest.raises(ValueError, match=r"'model\.w'.*not a box"):
        shard_pieces(meta, scatter)
    whole = Scatter(("model.w", ()), "m", "weight", 0, (6, 8), (8, 1), (6, 8), torch.float32)
    pieces = shard_pieces(meta, whole)
    assert [(owners, p.offset, p.src_shape) for owners, p in pieces] == [
        ([0], 0, (3, 8)),
        ([1], 24, (3, 8)),
    ]


def test_the_finite_check_reads_runs_of_the_staged_bytes_and_names_the_parameter() -> None:
    """A staging slot's adjacent floating copies of one dtype are checked as one run
    (padding or another dtype ends it); a NaN anywhere is refused naming its tensor."""
    from wt_kits.stream import aligned_layout, floating_runs
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine

    tensors = {
        "a": torch.randn(16),
        "b": torch.randn(4, 4),  # adjacent to a: one run of 32
        "i": torch.arange(8),
        "c": torch.randn(3).half(),  # 6 bytes: padding ends the run
        "d": torch.randn(5).half(),
    }
    sizes = [t.nbytes for t in tensors.values()]
    offsets, end = aligned_layout(sizes)
    base = torch.zeros(end, dtype=torch.uint8)
    views = {
        name: base[o : o + n].view(t.dtype).view(t.shape)
        for (name, t), o, n in zip(tensors.items(), offsets, sizes, strict=True)
    }
    for name, t in tensors.items():
        views[name].copy_(t)
    pieces = [(t.dtype, o, n) for t, o, n in zip(tensors.values(), offsets, sizes, strict=True)]
    runs = [base[a:b].view(dtype) for dtype, a, b in floating_runs(pieces)]
    assert [(r.dtype, r.numel()) for r in runs] == [
        (torch.float32, 32), (torch.float16, 3), (torch.float16, 5),
    ]  # fmt: skip
    ShardedRDTTrainerEngine._check_finite(views, runs)  # all finite: passes
    for name in ("a", "b", "c", "d"):
        saved = views[name].clone()
        views[name].view(-1)[-1] = float("nan")
        with pytest.raises(ValueError, match=f"non-finite values .* '{name}'"):
            ShardedRDTTrainerEngine._check_finite(views, runs)
        views[name].copy_(saved)
