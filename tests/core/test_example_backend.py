"""The third-party example backend `example_file` (distribution wt-example), end to end.

The trainer runs in the test process; the workers are `WorkerPool` processes
that create their engine through `WeightTransferEngineFactory`, so the only
way they can find `example_file` is wt-example's entry points.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.helpers import ExampleNet, expected_digests
from tests.harness import FanoutClient, WorkerPool
from weight_transfer import (
    ModuleSource,
    WeightSyncRPCError,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

NAMES = [n for n, _ in ExampleNet().named_parameters()]


def _info_cls() -> type:
    from wt_example.trainer import FileTrainerInitInfo

    return FileTrainerInitInfo


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool("example_file", 2, names=NAMES) as p:
        yield p


def test_both_factories_find_example_file_through_entry_points() -> None:
    for factory, module, cls_name in (
        (WeightTransferTrainerFactory, "wt_example.trainer", "FileTrainerEngine"),
        (WeightTransferEngineFactory, "wt_example.worker", "FileWorkerEngine"),
    ):
        info = factory.available_backends()["example_file"]
        assert (info.distribution, info.target) == ("wt-example", f"{module}:{cls_name}")
        assert info.version
        cls = factory.get_engine_class("example_file")
        assert (cls.__module__, cls.__name__) == (module, cls_name)
        assert factory.registry._registered.get("example_file") is None  # not registered by hand


def test_three_rounds_move_mixed_dtype_weights_bit_exactly(
    pool: WorkerPool, tmp_path: Path
) -> None:
    model = ExampleNet(seed=1)
    dtypes = {str(p.dtype) for p in model.parameters()}
    assert dtypes == {"torch.float32", "torch.bfloat16", "torch.int64"}
    engine = WeightTransferTrainerFactory.trainer_init(
        _info_cls()(str(tmp_path / "xfer"), rank=0),
        client=pool.client(),
        source=ModuleSource(model),
    )
    assert engine.is_sender
    previous: dict[str, str] | None = None
    for step in range(1, 4):
        model.perturb(step)
        engine.send_weights()
        expected = expected_digests(model)
        assert list(expected) == NAMES
        got = pool.each("digests")
        assert got == [expected, expected], f"round {step}"
        if previous is not None:
            assert all(expected[n] != previous[n] for n in NAMES), "weights did not change"
        previous = expected
    assert os.listdir(tmp_path / "xfer") == ["round-3.pt"]  # each round replaces the last
    engine.shutdown()
    assert os.listdir(tmp_path / "xfer") == []


def test_non_sender_rank_iterates_but_does_not_touch_the_wire(
    pool: WorkerPool, tmp_path: Path
) -> None:
    class Unreachable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"rank 1 called the client: {name}")

    class CountingSource(ModuleSource):
        passes = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            CountingSource.passes += 1
            return super().__iter__()

    source = CountingSource(ExampleNet(seed=2))
    engine = WeightTransferTrainerFactory.trainer_init(
        _info_cls()(str(tmp_path / "x"), rank=1), client=Unreachable(), source=source
    )
    assert not engine.is_sender
    before = pool.each("digests")
    engine.send_weights()
    assert pool.each("digests") == before
    assert CountingSource.passes == 1  # it still ran the (possibly collective) pass
    assert not (tmp_path / "x").exists()


def test_a_failing_worker_raises_naming_the_worker(tmp_path: Path) -> None:
    with WorkerPool("example_file", 2, names=NAMES) as failing:
        FanoutClient([failing.addresses[1]]).call("set_fail_on", "layers.0.weight")
        engine = WeightTransferTrainerFactory.trainer_init(
            _info_cls()(str(tmp_path), rank=0),
            client=failing.client(),
            source=ModuleSource(ExampleNet(seed=3)),
        )
        with pytest.raises(WeightSyncRPCError) as err:
            engine.send_weights()
        assert err.value.method == "update_weights"
        assert (
            "worker 1: ValueError: RecordingModel has no parameter named 'layers.0.weight'"
            in str(err.value)
        )
        engine.shutdown()
        assert os.listdir(tmp_path) == []
