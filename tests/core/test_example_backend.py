"""The third-party example backend `example_file` (distribution wt-example), end to end.

The trainer runs in the test process; the workers are `WorkerPool` processes
that create their engine through `WeightTransferEngineFactory`, so the only
way they can find `example_file` is wt-example's entry points.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.helpers import ExampleNet
from tests.harness import WorkerPool
from weight_transfer import (
    ModuleSource,
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
