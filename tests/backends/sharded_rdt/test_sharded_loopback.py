"""`sharded_rdt` end to end over the loopback transport: plan, routing, replay, layout, scatter.

Real trainer engines and real worker engines in this process; every check
compares each consumer's parameters bit for bit with a fresh shard loaded
the ordinary way (`models.reference`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from wt_tools.counting import HostSyncs, ProducerCalls

from tests.backends.sharded_rdt.models import (
    EXPERTS,
    ShardedModel,
    UnsupportedModel,
    checkpoint,
    held_part,
    reference,
)
from tests.sources import DictSource
from weight_transfer import layerwise_groups
from weight_transfer.runtime.control import ControlRefused, with_control_key
from weight_transfer.runtime.worker_round import guarded
from weight_transfer.testing.seams import on_bucket_landed
from wt_sharded_rdt.protocol import ShardedRDTUpdateInfo

pytestmark = pytest.mark.timeout(120)


class HeldSource(DictSource):
    """A trainer rank holding `held` of the tensors (None for the others)."""

    def __init__(self, tensors: dict[str, torch.Tensor], held: set[str] | None = None) -> None:
        super().__init__(tensors)
        self.held = held

    def held_names(self) -> set[str] | None:
        return self.held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, tensor in self.tensors.items():
            yield name, tensor if self.held is None or name in self.held else None


def total_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_consumers_pull_their_share(shards: Any, tp: int) -> None:
    s = shards(tp)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        for seed in (2, 3, 2):
            source.tensors = checkpoint(seed)
            trainer.send_weights()
            s.assert_serving(seed)
            for engine, model in zip(s.engines, s.models, strict=True):
                share = model.kept_bytes()
                assert abs(engine.pulled_bytes - share) <= 0.05 * share
                if tp > 1:
                    assert engine.pulled_bytes < total_bytes(source.tensors) / tp * 1.1
    finally:
        trainer.shutdown()


def test_two_pipeline_producers_feed_three_replicas(shards: Any) -> None:
    s = shards(1, replicas=3)
    tensors = checkpoint(1)
    sources = [HeldSource(tensors, held_part(tensors, r, 2)) for r in range(2)]
    rank1 = s.trainer(sources[1], rank=1, client=object(), num_trainer_ranks=2)
    rank0 = s.trainer(sources[0], rank=0, num_trainer_ranks=2)
    payloads = [rank0.get_worker_init_payload(r) for r in range(3)]
    assert [p["replica_rank"] for p in payloads] == [0, 1, 2]
    assert len(payloads[0]["owner_sets"]) == 2  # each name held by exactly one of the two ranks
    try:
        for seed in (2, 3):
            for src in sources:
                src.tensors = checkpoint(seed)
            other = threading.Thread(target=rank1.send_weights)
            other.start()
            rank0.send_weights()
            other.join(30)
            assert not other.is_alive()
            s.assert_serving(seed)
    finally:
        rank0.shutdown()
        rank1.shutdown()


def test_replicated_producers_share_the_pulls(shards: Any) -> None:
    """Two ranks holding everything: consumers spread their groups over both."""
    s = shards(2)
    tensors = checkpoint(1)
    sources = [HeldSource(tensors) for _ in range(2)]
    rank1 = s.trainer(sources[1], rank=1, client=object(), num_trainer_ranks=2)
    rank0 = s.trainer(sources[0], rank=0, num_trainer_ranks=2)
    try:
        for src in sources:
            src.tensors = checkpoint(2)
        other = threading.Thread(target=rank1.send_weights)
        other.start()
        rank0.send_weights()
        other.join(30)
        s.assert_serving(2)
        for engine in s.engines:
            assert engine.plan is not None
            assert {c.owner for c in engine.plan.chunks} == {0, 1}
    finally:
        rank0.shutdown()
        rank1.shutdown()


# -- refusals at init, each naming the culprit ------------------------------------------------
def test_orphan_name_is_refused(shards: Any) -> None:
    s = shards(1)
    tensors = checkpoint(1)
    held = [held_part(tensors, r, 2) for r in range(2)]
    held[1].discard("norm.weight")
    rank1 = s.trainer(HeldSource(tensors, held[1]), rank=1, client=object(), num_trainer_ranks=2)
    try:
        with pytest.raises(ValueError, match=r"no trainer rank holds 'norm\.weight'"):
            s.trainer(HeldSource(tensors, held[0]), rank=0, num_trainer_ranks=2)
    finally:
        rank1.shutdown()


def test_disagreeing_metadata_is_refused(shards: Any) -> None:
    s = shards(1)
    tensors = checkpoint(1)
    other = dict(tensors)
    other["norm.weight"] = torch.zeros(7)
    rank1 = s.trainer(HeldSource(other), rank=1, client=object(), num_trainer_ranks=2)
    try:
        with pytest.raises(ValueError, match="trainer rank 1 describes different metadata"):
            s.trainer(HeldSource(tensors), rank=0, num_trainer_ranks=2)
    finally:
        rank1.shutdown()


def test_loader_op_outside_the_allowlist_is_refused(shards: Any) -> None:
    s = shards(1, model_cls=UnsupportedModel)
    with pytest.raises(NotImplementedError, match=r"'norm.weight'.*to is not a slice op"):
        s.trainer(HeldSource(checkpoint(1)))


def test_bad_held_names_are_refused(shards: Any) -> None:
    s = shards(1)
    with pytest.raises(ValueError, match="held_names\\(\\) lists 'nope'"):
        s.trainer(HeldSource(checkpoint(1), {"nope"}))
    with pytest.raises(ValueError, match="held_names\\(\\) is empty"):
        s.trainer(HeldSource(checkpoint(1), set()))


# -- failures in a sync keep the previous weights; the next sync works -------------------------
class BrokenSource(HeldSource):
    """Yields None for `name` although it is held (a rank that lost a shard)."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        super().__init__(tensors)
        self.name = name

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, tensor in self.tensors.items():
            yield name, None if name == self.name else tensor


def test_held_name_yielding_none_fails_the_sync_and_keeps_weights(shards: Any) -> None:
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        trainer.source = BrokenSource(checkpoint(3), "layers.1.o.weight")
        with pytest.raises(RuntimeError, match=r"'layers\.1\.o\.weight' is in held_names\(\) but"):
            trainer.send_weights()
        s.assert_serving(2)
        trainer.source = source
        source.tensors = checkpoint(3)
        trainer.send_weights()
        s.assert_serving(3)
    finally:
        trainer.shutdown()


def test_silent_consumer_fails_the_sync_within_the_watchdog(shards: Any) -> None:
    """A consumer that never pulls: the trainer fails within stall_timeout_s, naming it."""
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source, stall_timeout_s=2.0)
    try:
        s.replicas[0].skip_update = {1}
        source.tensors = checkpoint(2)
        started = time.monotonic()
        with pytest.raises(Exception, match=r"consumers \[1\]|consumer 1"):
            trainer.send_weights()
        assert time.monotonic() - started < 20
        # consumer 1 never saw the update; its host ends the round it holds open
        assert s.sessions[1].active
        s.sessions[1].abandon_round()
        assert not s.sessions[1].engine.round_open
        s.replicas[0].skip_update = set()
        trainer.send_weights()
        s.assert_serving(2)
    finally:
        trainer.shutdown()


def test_failing_scatter_rolls_back_and_next_sync_works(shards: Any) -> None:
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        loader_write = type(s.engines[1].new_loader()).write
        calls = {"n": 0}

        def failing(self: Any, writes: Any) -> None:
            calls["n"] += self.model is s.models[1]
            if calls["n"] == 1 and self.model is s.models[1]:
                loader_write(self, writes[: len(writes) // 2])  # half of a pull landed
                raise RuntimeError("disk on fire")
            loader_write(self, writes)

        pytest.MonkeyPatch().setattr(type(s.engines[1].new_loader()), "write", failing)
        source.tensors = checkpoint(3)
        with pytest.raises(Exception, match=r"consumer 1.*disk on fire"):
            trainer.send_weights()
        s.assert_serving(2)
        pytest.MonkeyPatch().setattr(type(s.engines[1].new_loader()), "write", loader_write)
        trainer.send_weights()
        s.assert_serving(3)
    finally:
        trainer.shutdown()


def test_degraded_live_set_and_rejoin(shards: Any) -> None:
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        source.tensors = checkpoint(3)
        trainer.send_weights(live_consumers=[0])
        s.assert_serving(3, [0])
        s.assert_serving(2, [1])
        # consumer 1 restarts: a fresh engine and model, re-initialized from the kept payload
        fresh = shards(2)
        s.models[1], s.engines[1], s.sessions[1] = (
            fresh.models[1],
            fresh.engines[1],
            fresh.sessions[1],
        )
        s.replicas[0].sessions[1] = fresh.sessions[1]
        fresh.sessions[1].init_weight_transfer_engine(trainer.get_worker_init_payload())
        trainer.send_weights()
        s.assert_serving(3)
    finally:
        trainer.shutdown()


def test_expert_parallel_consumers_skip_foreign_experts(shards: Any) -> None:
    s = shards(2)
    trainer = s.trainer(HeldSource(checkpoint(1)))
    try:
        for rank, engine in enumerate(s.engines):
            assert engine.plan is not None
            pulled = {key[0] for chunk in engine.plan.chunks for key in chunk.keys}
            experts = {n for n in pulled if ".experts." in n}
            assert experts == {
                f"layers.{i}.experts.{e}.w1.weight"
                for i in range(2)
                for e in range(EXPERTS)
                if e % 2 == rank
            }
    finally:
        trainer.shutdown()


def test_update_from_another_trainer_is_refused(shards: Any) -> None:
    s = shards(1)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        with pytest.raises(ControlRefused, match=r"which is alive.*replace_trainer=True"):
            s.trainer(HeldSource(checkpoint(1)), producer_prefix=s.prefix + "-b")
        source.tensors = checkpoint(2)
        trainer.send_weights()  # the engine still serves the first trainer
        s.assert_serving(2)
        other = s.trainer(
            HeldSource(checkpoint(3)), producer_prefix=s.prefix + "-c", replace_trainer=True
        )
        try:
            other.send_weights()
            s.assert_serving(3)
            with pytest.raises(Exception, match="now serves trainer"):
                trainer.send_weights()
        finally:
            other.shutdown()
    finally:
        trainer.shutdown()


def test_expert_load_balancing_is_refused(shards: Any) -> None:
    """EPLB moves experts at run time: a recorded plan would scatter into the wrong ones."""
    from types import SimpleNamespace

    from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

    s = shards(1)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            rank=0, world_size=1, data_parallel_size=1, enable_eplb=True
        )
    )
    engine = ShardedRDTWorkerEngine(None, config, "cpu", s.models[0])
    s.engines[0], s.sessions[0].engine = engine, guarded(engine)
    with pytest.raises(Exception, match="enable_eplb"):
        s.trainer(HeldSource(checkpoint(1)))


def test_non_finite_weights_are_refused_before_publishing(shards: Any) -> None:
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        bad = checkpoint(3)
        bad["layers.1.o.weight"][0, 0] = float("nan")
        source.tensors = bad
        with pytest.raises(ValueError, match=r"non-finite values .* 'layers\.1\.o\.weight'"):
            trainer.send_weights()
        s.assert_serving(2)
        trainer.check_finite = False
        trainer.send_weights()
        assert torch.isnan(s.models[0].layers[1].o.weight).any()
    finally:
        trainer.shutdown()


class PlainModel(torch.nn.Module):
    """No `load_weights`: copied by name, including an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.empty = torch.nn.Parameter(torch.zeros(0, 5))
        self.ints = torch.nn.Parameter(torch.zeros(7, dtype=torch.int32), requires_grad=False)


def plain_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.randn(3, generator=g),
        "empty": torch.zeros(0, 5),
        "ints": torch.randint(-9, 9, (7,), generator=g, dtype=torch.int32),
    }


def test_a_plain_module_with_an_empty_parameter(shards: Any) -> None:
    """Copy-by-name loading, a zero-element slice and an odd-sized int slice share one pull."""
    from weight_transfer import WorkerPosition, WorkerSession
    from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

    s = shards(1)
    model = PlainModel()
    engine = ShardedRDTWorkerEngine(None, WorkerPosition(), "cpu", model)
    s.engines[0], s.sessions[0] = engine, WorkerSession(engine)
    s.replicas[0].sessions[0] = s.sessions[0]
    source = HeldSource(plain_tensors(1))
    trainer = s.trainer(source)
    try:
        for seed in (2, 3):
            source.tensors = plain_tensors(seed)
            trainer.send_weights()
            for name, want in source.tensors.items():
                assert torch.equal(model.get_parameter(name), want), name
        assert engine.plan is not None
        (chunk,) = [c for c in engine.plan.chunks if ("empty", ()) in c.keys]
        assert chunk.numels[chunk.keys.index(("empty", ()))] == 0
    finally:
        trainer.shutdown()


# -- verified bytes ------------------------------------------------------------------------
@contextlib.contextmanager
def corrupting(engine: Any, name: str, at: int = 5) -> Iterator[int]:
    """Flip byte `at` of `name`'s first slice in every blob of `name` that `engine`
    receives, after it landed and before it is checked (`on_bucket_landed`, run
    by the consumer on each landed pull); yields the pull's index."""
    assert engine.plan is not None
    chunk = next(c for c in engine.plan.chunks if any(k[0] == name for k in c.keys))
    offset = chunk.offsets[[k[0] for k in chunk.keys].index(name)] + at
    slots = {slot.data_ptr() for slot in engine.slots}

    def flip(k: int, buf: torch.Tensor) -> None:
        if k == chunk.index and buf.data_ptr() in slots:  # this consumer's pull only
            buf[offset] ^= 0xFF

    with on_bucket_landed(flip):
        yield chunk.index


def test_verified_sync_refuses_a_corrupted_pull_and_keeps_every_weight(shards: Any) -> None:
    s = shards(2)
    name = "layers.1.o.weight"
    # without verify the flipped byte lands in the model unnoticed: the hook does corrupt
    plain_source = HeldSource(checkpoint(1))
    plain = s.trainer(plain_source)
    with corrupting(s.engines[1], name):
        plain_source.tensors = checkpoint(2)
        plain.send_weights()
    s.wait_closed()
    assert not torch.equal(s.models[1].layers[1].o.weight, reference(2, 1, 2)["layers.1.o.weight"])
    plain.shutdown()

    source = HeldSource(checkpoint(3))
    trainer = s.trainer(source, producer_prefix=s.prefix + "-v", verify=True)
    try:
        trainer.send_weights()
        s.assert_serving(3)  # a clean verified sync is bit-exact
        with corrupting(s.engines[1], name) as pull:
            source.tensors = checkpoint(2)
            with pytest.raises(
                Exception,
                match=rf"verify: consumer 1: pull {pull} \(group 2\) from {s.prefix}-v-rk0: the "
                rf"slice of '{name}' \(narrow\(1, 16, 16\)\) arrived different",
            ):
                trainer.send_weights()
        s.assert_serving(3)
        trainer.send_weights()  # no re-init
        s.assert_serving(2)
    finally:
        trainer.shutdown()


# -- an update or a handshake rewritten on its way -------------------------------------------
def forge_updates(engine: Any, rewrite: Any) -> None:
    """Rewrite every update `engine` receives, after core parsed (and checked) it."""
    receive = type(engine).receive_weights

    def forged(update_info: ShardedRDTUpdateInfo) -> None:
        receive(engine, rewrite(update_info))

    engine.receive_weights = forged


@pytest.mark.parametrize(
    ("trainer_live", "rewrite", "refusal"),
    [
        (None, lambda u: replace(u, trainer_id=""), r"field 'trainer_id' is ''"),
        (None, lambda u: replace(u, sync_id=u.sync_id + 5), r"'sync_id'"),
        (None, lambda u: replace(u, live_consumers=[0]), r"consumer 1 skipped.*'live_consumers'"),
        (
            None,
            lambda u: replace(u, live_consumers=[0, 1, 99]),
            r"'live_consumers' names consumer 99",
        ),
        ([0], lambda u: replace(u, live_consumers=[0, 1]), r"consumer 1 pulled .*'live_consumers'"),
    ],
    ids=["trainer_id", "sync_id ahead", "left out", "out of range", "let in"],
)
def test_a_rewritten_update_is_refused_and_the_next_sync_works(
    shards: Any, trainer_live: list[int] | None, rewrite: Any, refusal: str
) -> None:
    """Consumer 1's update info is rewritten: the sync fails naming the field, every
    consumer keeps its weights bit-exactly, and the next sync (not rewritten) works."""
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        forge_updates(s.engines[1], rewrite)
        source.tensors = checkpoint(3)
        with pytest.raises(Exception, match=refusal):
            trainer.send_weights(live_consumers=trainer_live)
        s.assert_serving(2)
        del s.engines[1].receive_weights
        trainer.send_weights()
        s.assert_serving(3)
    finally:
        trainer.shutdown()


def _forge_entry(field: str, name: str, value: Any) -> Any:
    def forge(payload: dict[str, Any]) -> None:
        payload[field][payload["names"].index(name)] = value

    return forge


@pytest.mark.parametrize(
    ("field", "forge"),
    [
        ("shapes", _forge_entry("shapes", "layers.0.router.weight", [32, 4])),
        ("dtype_names", _forge_entry("dtype_names", "norm.weight", "bfloat16")),
        ("names", _forge_entry("names", "layers.1.o.weight", "layers.1.o.bias")),
        ("verify", lambda payload: payload.update(verify=True)),
        ("owner_sets", lambda payload: payload.update(owner_sets=[[0], [0]])),
    ],
    ids=["shapes", "dtype_names", "names", "verify", "owner_sets"],
)
def test_a_handshake_that_disagrees_with_the_producers_is_refused(
    shards: Any, field: str, forge: Any
) -> None:
    """Consumer 1 is handed a handshake that does not describe what the producers
    serve: its init is refused naming the field, before it plans or reserves anything;
    it keeps serving its weights, and the next sync re-admits it with the real one."""
    s = shards(2)
    source = HeldSource(checkpoint(1))
    trainer = s.trainer(source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        payload = trainer.get_worker_init_payload()
        forge(payload)
        signed = with_control_key(payload, trainer.client.control)  # as its trainer sends it
        with pytest.raises(ValueError, match=f"init_info: field '{field}' "):
            s.sessions[1].init_weight_transfer_engine(signed)
        s.assert_serving(2)
        source.tensors = checkpoint(3)
        trainer.send_weights()  # consumer 1 refuses the start (no producers): re-admitted
        s.assert_serving(3)
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(
    ("layers", "lookahead"), [(100, None), (800, None), (100, 7)]
)  # 1,102 and 8,802 tensors; spans of 4 groups
def test_a_warm_sync_costs_host_syncs_per_group_and_producer_calls_per_span(
    shards: Any, layers: int, lookahead: int | None
) -> None:
    """One warm sync, trainer and consumer in this process: the host syncs on every
    thread stay at most 2 per gather group and side, whatever the tensor count; the
    trainer publishes to its producer (a Ray actor call on the nixl carrier) once per
    span of groups, and the consumer pulls once per span and frees once per pull. Left
    to the staging budget, a small model is one span: one publish, one pull."""
    s = shards(1, model_cls=functools.partial(ShardedModel, layers=layers))
    source = HeldSource(checkpoint(1, layers))
    trainer = s.trainer(source, gather_lookahead=lookahead)
    try:
        trainer.send_weights()  # cold: the recording of the loaders, plans
        source.tensors = checkpoint(2, layers)
        with HostSyncs() as syncs, ProducerCalls() as calls:
            trainer.send_weights()
        s.wait_closed()
    finally:
        trainer.shutdown()
    want = reference(2, 0, 1, layers)
    for name, got in s.models[0].state_dict().items():
        assert torch.equal(got, want[name]), name
    groups = len(layerwise_groups(list(source.tensors)))
    assert syncs.total <= 2 * 2 * groups, (
        f"{len(source.tensors)} tensors in {groups} groups: {dict(syncs.counts)} host syncs"
    )
    c = calls.counts
    where = f"{groups} groups, spans of {trainer.span}: {dict(c)}"
    assert c["LoopbackHost.begin_sync"] == c["LoopbackHost.end_sync"] == 1, where
    spans = -(-groups // trainer.span)
    assert spans == (1 if lookahead is None else -(-groups // 4)), where
    assert c["LoopbackHost.publish"] == spans, where
    pulls = c["LoopbackClient.pull"]
    assert pulls == spans, where  # one pull per span: its slices fit one pull
    assert c["LoopbackClient.free"] == pulls, where  # one free call per landed pull
