"""`sparse_nccl` end to end: trainer rank 0 in the test process, workers in `WorkerPool`
processes (engines created through entry points) holding a `PatchableModel`, over a
private gloo group. Every check compares the workers' parameters bit for bit with
the state the test computes itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.backends.sparse_nccl.helpers import (
    MODEL_FACTORY,
    CountingClient,
    applied,
    assert_same_bits,
    random_patch,
)
from tests.backends.sparse_nccl.models import initial_state
from tests.harness import WorkerPool
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks
from weight_transfer.runtime.waiting import TransferTimeout
from wt_kits.group import free_port
from wt_sparse_nccl import (
    SparseNCCLTrainerEngine,
    SparseNCCLTrainerInitInfo,
    SparseWeightPatch,
)
from wt_sparse_nccl.wire import HEADER_WORDS

W0, B0, W1, B1 = "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"
BF16, FP16 = "mixed.bf16_weight", "mixed.fp16_weight"
TIMEOUT_S = 30.0


@dataclass
class Rig:
    pool: WorkerPool
    client: CountingClient
    engine: SparseNCCLTrainerEngine

    def states(self) -> list[dict[str, torch.Tensor]]:
        return self.pool.each("state_dict")

    def state(self) -> dict[str, torch.Tensor]:
        """The workers' (identical) state."""
        first, *others = self.states()
        for other in others:
            assert_same_bits(other, first)
        return first

    def assert_state(self, want: dict[str, torch.Tensor]) -> None:
        for got in self.states():
            assert_same_bits(got, want)


def connect(
    pool: WorkerPool, client: CountingClient, timeout_s: float = TIMEOUT_S
) -> SparseNCCLTrainerEngine:
    info = SparseNCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + len(pool.processes), rank=0, timeout_s=timeout_s, device="cpu"
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    assert isinstance(engine, SparseNCCLTrainerEngine)
    return engine


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with WorkerPool("sparse_nccl", 2, model_factory=MODEL_FACTORY) as pool:
        client = CountingClient(pool.client(timeout_s=60.0))
        engine = connect(pool, client)
        yield Rig(pool, client, engine)
        engine.shutdown()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def wt_sync_started(
        self, backend: str, sync_id: int, num_params: int, total_bytes: int
    ) -> None:
        self.events.append(("started", {"backend": backend, "sync_id": sync_id}))

    @hookimpl
    def wt_chunk_moved(self, backend: str, index: int, nbytes: int) -> None:
        self.events.append(("chunk", {"index": index, "nbytes": nbytes}))

    @hookimpl
    def wt_sync_finished(
        self, backend: str, num_params: int, total_bytes: int, weight_version: str | None
    ) -> None:
        self.events.append(
            (
                "finished",
                {"num_params": num_params, "total_bytes": total_bytes, "v": weight_version},
            )
        )

    @hookimpl
    def wt_sync_failed(self, backend: str, error: BaseException) -> None:
        self.events.append(("failed", {"error": error}))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    register_hooks(rec)
    yield rec
    plugin_manager().unregister(rec)


def wire_bytes(patches: list[SparseWeightPatch]) -> int:
    return sum(p.nnz * (p.indices.element_size() + p.values.element_size()) for p in patches)


def test_three_rounds_land_bit_exactly_and_only_nnz_bytes_travel(
    rig: Rig, gen: torch.Generator, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.assert_state(initial_state())
    assert rig.engine.channel.group is not None
    sent: list[tuple[torch.dtype, int]] = []
    broadcast = rig.engine.channel.group.broadcast

    def spy(tensor: torch.Tensor, src: int = 0) -> Any:
        sent.append((tensor.dtype, tensor.numel()))
        return broadcast(tensor, src)

    monkeypatch.setattr(rig.engine.channel.group, "broadcast", spy)
    state = rig.state()
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for round_ in range(3):
        patches = [
            random_patch(W0, state, 20, gen, index_dtype=torch.int32, specials=round_ == 0),
            random_patch(B1, state, 3, gen, index_dtype=torch.int64),
            random_patch(BF16, state, 9, gen, index_dtype=torch.int32, specials=True),
            random_patch(FP16, state, 7, gen, index_dtype=torch.int64, specials=True),
            random_patch(W0, state, 5, gen, index_dtype=torch.int64),  # same name again: in order
        ]
        if round_ == 2:
            patches.append(random_patch(B0, state, 0, gen))  # an empty patch is fine
        rig.client.calls.clear()
        sent.clear()
        rig.engine.send_weights(patches, weight_version=f"v{round_}")

        state = applied(state, patches)
        rig.assert_state(state)
        assert rig.client.methods() == [
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ]
        (update,) = rig.client.updates()
        assert update["names"] == [p.name for p in patches]
        assert update["num_updates"] == [p.nnz for p in patches]
        assert update["dtype_names"][:4] == ["float32", "float32", "bfloat16", "float16"]
        assert update["index_dtype_names"][:4] == ["int32", "int64", "int32", "int64"]
        assert update["shapes"][0] == [12, 16]
        # The fixed-size header, then one broadcast per index dtype and per values
        # dtype, O(nnz) bytes in all.
        assert sent[0] == (torch.int64, HEADER_WORDS)
        data = sent[1:]
        assert len(data) == 5
        assert sum(n for _, n in data) == wire_bytes(patches) < full_bytes / 3
        assert {d for d, _ in data} == {torch.uint8}
        assert rig.client.calls[-1] == ("finish_weight_update", f"v{round_}")

    kinds = [kind for kind, _ in recorder.events]
    assert kinds == ["started", "chunk", "finished"] * 3
    finished = [data for kind, data in recorder.events if kind == "finished"]
    assert finished[-1] == {"num_params": 6, "total_bytes": wire_bytes(patches), "v": "v2"}


def test_three_chunks_inside_one_round(rig: Rig, gen: torch.Generator, recorder: Recorder) -> None:
    state = rig.state()
    chunks = [
        [random_patch(W1, state, 10, gen), random_patch(BF16, state, 4, gen)],
        [random_patch(W1, state, 10, gen, index_dtype=torch.int32)],  # may overlap chunk 1
        [random_patch(FP16, state, 6, gen), random_patch(B0, state, 2, gen)],
    ]
    rig.client.calls.clear()
    rig.engine.begin()
    for chunk in chunks:
        rig.engine.send_weight_chunk(chunk)
    rig.engine.end("chunked")
    for chunk in chunks:
        state = applied(state, chunk)
    rig.assert_state(state)
    assert rig.client.methods() == ["start_weight_update"] + ["update_weights"] * 3 + [
        "finish_weight_update"
    ]
    assert [kind for kind, _ in recorder.events] == [
        "started",
        "chunk",
        "chunk",
        "chunk",
        "finished",
    ]
    total = sum(wire_bytes(c) for c in chunks)
    assert recorder.events[-1][1] == {"num_params": 5, "total_bytes": total, "v": "chunked"}

    # The caller may drive the client itself, too.
    more = [[random_patch(B1, state, 2, gen)], [random_patch(W0, state, 3, gen)]]
    rig.engine.client.start_weight_update()
    for chunk in more:
        rig.engine.send_weight_chunk(chunk)
    rig.engine.client.finish_weight_update()
    for chunk in more:
        state = applied(state, chunk)
    rig.assert_state(state)


def test_empty_patch_lists_make_no_call(rig: Rig, gen: torch.Generator) -> None:
    state = rig.state()
    rig.client.calls.clear()
    rig.engine.send_weights([])
    rig.engine.send_weights(None)
    rig.engine.send_weight_chunk([])
    rig.engine.send_weight_chunk(None)
    rig.engine.send_weight_chunk()  # an empty chunk, as in vLLM
    rig.engine.begin()
    rig.engine.send_weight_chunk()
    rig.engine.end()
    assert [c[0] for c in rig.client.calls] == ["start_weight_update", "finish_weight_update"]
    rig.client.calls.clear()
    rig.assert_state(state)

    # A non-sender rank does nothing at all, whatever it is given.
    other = WeightTransferTrainerFactory.trainer_init(
        SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 3, rank=1), client=rig.client
    )
    assert isinstance(other, SparseNCCLTrainerEngine)
    other.send_weights([random_patch(W0, state, 3, gen)])
    other.begin()
    other.send_weight_chunk([random_patch(W0, state, 3, gen)])
    other.end()
    assert rig.client.calls == []
    assert other.channel.group is None
    rig.assert_state(state)


def _bad_patches(state: dict[str, torch.Tensor]) -> dict[str, tuple[SparseWeightPatch, str]]:
    shape = tuple(state[W0].shape)
    idx = torch.tensor([1, 5, 7])
    vals = torch.ones(3)
    return {
        "out of range": (
            SparseWeightPatch(W0, torch.tensor([0, 192]), torch.ones(2), shape),
            "index 192 at position 1 is outside",
        ),
        "negative index": (
            SparseWeightPatch(W0, torch.tensor([-1]), torch.ones(1), shape),
            "index -1 at position 0 is outside",
        ),
        "length mismatch": (SparseWeightPatch(W0, idx, torch.ones(4), shape), "3 indices but 4"),
        "duplicates": (
            SparseWeightPatch(W0, torch.tensor([4, 9, 4], dtype=torch.int32), vals, shape),
            "index 4 appears more than once",
        ),
        "2-D indices": (
            SparseWeightPatch(W0, idx.reshape(3, 1), vals, shape),
            "indices must be 1-D",
        ),
        "2-D values": (SparseWeightPatch(W0, idx, vals.reshape(1, 3), shape), "values must be 1-D"),
        "float indices": (
            SparseWeightPatch(W0, idx.float(), vals, shape),
            "indices must be int32 or int64",
        ),
        "int16 indices": (
            SparseWeightPatch(W0, idx.to(torch.int16), vals, shape),
            "indices must be int32 or int64",
        ),
        "complex values": (
            SparseWeightPatch(W0, idx, vals.to(torch.complex64), shape),
            "cannot travel",
        ),
        "no full shape": (
            SparseWeightPatch(W0, idx, vals, None),  # type: ignore[arg-type]
            "full_shape must be",
        ),
    }


def test_bad_patches_are_refused_on_the_trainer_before_any_call(
    rig: Rig, gen: torch.Generator
) -> None:
    state = rig.state()
    good = random_patch(B0, state, 3, gen)
    for case, (bad, message) in _bad_patches(state).items():
        rig.client.calls.clear()
        for send in (rig.engine.send_weights, rig.engine.send_weight_chunk):
            with pytest.raises(ValueError, match=rf"patch 1 \('{W0}'\): .*{message}"):
                send([good, bad])
        assert rig.client.calls == [], case
    with pytest.raises(TypeError, match="patch 0: expected a SparseWeightPatch"):
        rig.engine.send_weights([("w", torch.ones(1))])  # type: ignore[list-item]
    assert rig.client.calls == []
    rig.assert_state(state)


def test_a_source_is_refused() -> None:
    from weight_transfer import ModuleSource

    info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0)
    client = CountingClient(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delta backend"):
        WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )
    assert client.calls == []


def test_batches_the_workers_refuse_apply_nothing_and_the_next_sync_works(
    rig: Rig, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = rig.state()
    good = random_patch(W1, state, 12, gen)  # valid, and first in every bad batch
    refused = {
        "unknown name": (
            SparseWeightPatch("layers.9.weight", torch.tensor([0]), torch.ones(1), (4, 4)),
            "no parameter named 'layers.9.weight'",
        ),
        "shape": (
            SparseWeightPatch(B1, torch.tensor([3, 30]), torch.ones(2), (40,)),
            r"full shape \[40\] differs from the parameter's shape \[8\]",
        ),
        "dtype": (
            SparseWeightPatch(B1, torch.tensor([3]), torch.ones(1, dtype=torch.float16), (8,)),
            "values are torch.float16, the parameter is torch.float32",
        ),
    }
    for case, (bad, message) in refused.items():
        with pytest.raises(WeightSyncRPCError, match=rf"patch 1 \('{bad.name}'\): .*{message}"):
            rig.engine.send_weights([good, bad])
        rig.assert_state(state)
        assert rig.engine.channel.group is not None, case

    # Checks the trainer would have made, bypassed: the workers make them too.
    skipped = {
        "out of range": (
            SparseWeightPatch(B1, torch.tensor([1, 8]), torch.ones(2), (8,)),
            "index 8 at position 1 is outside",
        ),
        "duplicates": (
            SparseWeightPatch(B1, torch.tensor([2, 2]), torch.ones(2), (8,)),
            "index 2 appears more than once",
        ),
    }
    import wt_sparse_nccl.trainer

    monkeypatch.setattr(wt_sparse_nccl.trainer, "check_patches", lambda patches: None)
    for bad, message in skipped.values():
        rig.client.start_weight_update()
        with pytest.raises(WeightSyncRPCError, match=rf"patch 1 \('{B1}'\): .*{message}"):
            rig.engine.send_weight_chunk([good, bad])
        rig.assert_state(state)

    # A chunk refused mid-round rolls the earlier chunks of that round back, too.
    rig.engine.begin()
    rig.engine.send_weight_chunk([good])
    assert_same_bits({W1: rig.state()[W1]}, {W1: applied(state, [good])[W1]})  # in place
    with pytest.raises(WeightSyncRPCError, match="no parameter named"):
        rig.engine.send_weight_chunk([good, refused["unknown name"][0]])
    rig.assert_state(state)
    with pytest.raises(RuntimeError, match="end\\(\\) without an open round"):
        rig.engine.end()

    patches = [good, random_patch(FP16, state, 5, gen)]
    rig.engine.send_weights(patches)
    rig.assert_state(applied(state, patches))


def _rewritten(payload: dict[str, Any], field: str) -> dict[str, Any]:
    """`payload` with one entry of `field` changed (sizes, dtypes or names)."""
    out = {k: list(v) if isinstance(v, list) else v for k, v in payload.items()}
    if field == "num_updates":
        out["num_updates"][1] += 1  # the worker would receive one entry too many
    elif field == "num_updates-fewer":
        field = "num_updates"
        out["num_updates"][0] -= 1
    elif field == "dtype_names":
        out["dtype_names"][0] = "bfloat16"  # float32 values read as half their size
    elif field == "index_dtype_names":
        out["index_dtype_names"][2] = "int64"
    elif field == "names":
        out["names"][1] = B0  # same sizes, another parameter
    elif field == "shapes":
        out["shapes"][0] = list(reversed(out["shapes"][0]))  # same numel
    return out


REWRITES = ["num_updates", "num_updates-fewer", "dtype_names", "index_dtype_names", "names",
            "shapes"]  # fmt: skip


@pytest.mark.parametrize("field", REWRITES)
def test_an_update_info_that_differs_from_the_batch_is_refused_naming_the_field(
    rig: Rig, gen: torch.Generator, field: str
) -> None:
    """Sized from the trainer's header, the receive cannot abort the worker process (gloo
    kills a process whose receive size differs from the send): it takes the trainer's
    bytes whole, refuses the batch naming the field, and the group stays in step."""
    state = rig.state()
    group = rig.engine.channel.require()
    patches = [
        random_patch(W0, state, 20, gen, index_dtype=torch.int32),
        random_patch(B1, state, 3, gen),
        random_patch(BF16, state, 9, gen, index_dtype=torch.int32),
    ]
    rig.client.key = rig.engine.client.control
    rig.client.rewrite = lambda payload: _rewritten(payload, field)
    try:
        with pytest.raises(WeightSyncRPCError) as refused:
            rig.engine.send_weights(patches, weight_version="never")
    finally:
        rig.client.rewrite = None
    name = field.removesuffix("-fewer")
    assert f"field {name!r} differs from the batch the trainer sent" in str(refused.value)
    assert all(p.is_alive() for p in rig.pool.processes)
    rig.assert_state(state)
    assert rig.engine.channel.group is group  # the group stayed in step

    rig.client.calls.clear()
    rig.engine.send_weights(patches, weight_version="after")
    assert "init_weight_transfer_engine" not in rig.client.methods()
    rig.assert_state(applied(state, patches))


class _NeverDone:
    """A collective's work that never completes (a broadcast lost on the way)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("a work that never completes was waited on")


def test_a_refused_update_keeps_the_group_and_a_torn_down_one_is_re_formed_by_the_next_round(
    gen: torch.Generator,
) -> None:
    with WorkerPool("sparse_nccl", 1, model_factory=MODEL_FACTORY) as pool:
        client = CountingClient(pool.client(timeout_s=60.0))
        engine = connect(pool, client, timeout_s=3.0)
        state = initial_state()
        # An update the worker cannot parse is refused before anything is
        # received: nothing crossed the wire, so the group stays in step.
        client.start_weight_update()
        bad_update = {
            "names": [W0],
            "dtype_names": ["float32"],
            "index_dtype_names": ["int16"],
            "shapes": [[12, 16]],
            "num_updates": [1],
        }
        with pytest.raises(WeightSyncRPCError, match="index_dtype_names\\[0\\]"):
            client.update_weights(engine.client.control.sign(bad_update))
        patch = random_patch(W0, state, 4, gen)
        engine.send_weights([patch])
        state = applied(state, [patch])
        assert_same_bits(pool.each("state_dict")[0], state)

        # A broadcast the worker never receives leaves the two sides out of
        # step: the trainer's wait times out, it drops its end and says so.
        group = engine.channel.require()
        group.broadcast = lambda tensor, src=0: _NeverDone()  # type: ignore[method-assign,assignment]
        t0 = time.monotonic()
        # the trainer's own timeout, or the worker's if it reports first
        with pytest.raises((TransferTimeout, WeightSyncRPCError), match=r"within 3s|timed out"):
            engine.send_weights([random_patch(W0, state, 4, gen)])
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        assert engine.channel.group is None
        assert_same_bits(pool.each("state_dict")[0], state)

        # The next round re-forms the group first (a new handshake, same trainer).
        client.calls.clear()
        patch = random_patch(W0, state, 4, gen)
        engine.send_weights([patch])
        assert client.methods()[0] == "init_weight_transfer_engine"
        assert client.methods()[1:] == [
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ]
        assert engine.channel.group is not None and engine.channel.group is not group
        state = applied(state, [patch])
        assert_same_bits(pool.each("state_dict")[0], state)

        engine.shutdown()
        client.calls.clear()
        with pytest.raises(RuntimeError, match=r"no transfer group .*shut down"):
            engine.send_weights([patch])
        with pytest.raises(RuntimeError, match=r"no transfer group .*shut down"):
            engine.begin()
        assert client.calls == []


def test_cast_values_lands_floating_point_patches_in_their_targets_dtype(
    gen: torch.Generator,
) -> None:
    """`cast_values`: bf16 values into an fp32 parameter land as their fp32 casts (as
    vLLM's own sparse backend does); a non-float patch is still refused, naming it."""
    with WorkerPool("sparse_nccl", 1, model_factory=MODEL_FACTORY) as pool:
        info = SparseNCCLTrainerInitInfo(
            "127.0.0.1", free_port(), 2, rank=0, timeout_s=TIMEOUT_S, device="cpu",
            cast_values=True,
        )  # fmt: skip
        engine = WeightTransferTrainerFactory.trainer_init(info, client=pool.client(timeout_s=60))
        try:
            state = initial_state()
            fp32 = random_patch(W0, state, 20, gen, specials=True)
            bf16 = SparseWeightPatch(W0, fp32.indices, fp32.values.bfloat16(), fp32.full_shape)
            engine.send_weights([bf16])
            cast = SparseWeightPatch(W0, fp32.indices, bf16.values.float(), fp32.full_shape)
            want = applied(state, [cast])
            assert_same_bits(pool.each("state_dict")[0], want)
            assert not torch.equal(want[W0], applied(state, [fp32])[W0])  # the cast mattered
            ints = SparseWeightPatch(B1, torch.tensor([3]), torch.ones(1, dtype=torch.int32), (8,))
            with pytest.raises(WeightSyncRPCError, match=r"patch 0 \('layers\.1\.bias'\)"):
                engine.send_weights([ints])
            assert_same_bits(pool.each("state_dict")[0], want)
        finally:
            engine.shutdown()
