"""Lifecycle hooks: registered objects and entry-point plugins observe real syncs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.conftest import MakeDist
from tests.core.helpers import ExampleNet, expected_digests
from tests.harness import FanoutClient, WorkerPool
from weight_transfer import ModuleSource, WeightSyncRPCError, WeightTransferTrainerFactory
from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks, track_sync

NAMES = [n for n, _ in ExampleNet().named_parameters()]

pytestmark = pytest.mark.usefixtures("fresh_hooks")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def wt_sync_started(
        self, backend: str, sync_id: int, num_params: int, total_bytes: int
    ) -> None:
        self.events.append(
            (
                "started",
                dict(
                    backend=backend, sync_id=sync_id, num_params=num_params, total_bytes=total_bytes
                ),
            )
        )

    @hookimpl
    def wt_chunk_moved(
        self, backend: str, sync_id: int, index: int, num_chunks: int, nbytes: int
    ) -> None:
        self.events.append(
            ("chunk", dict(sync_id=sync_id, index=index, num_chunks=num_chunks, nbytes=nbytes))
        )

    @hookimpl
    def wt_sync_finished(
        self,
        backend: str,
        sync_id: int,
        num_params: int,
        total_bytes: int,
        seconds: float,
        weight_version: str | None,
    ) -> None:
        assert seconds > 0
        self.events.append(
            (
                "finished",
                dict(
                    sync_id=sync_id,
                    num_params=num_params,
                    total_bytes=total_bytes,
                    weight_version=weight_version,
                ),
            )
        )

    @hookimpl
    def wt_sync_failed(
        self, backend: str, sync_id: int, error: BaseException, seconds: float
    ) -> None:
        assert seconds >= 0
        self.events.append(("failed", dict(backend=backend, sync_id=sync_id, error=error)))


class Exploding:
    @hookimpl(tryfirst=True)
    def wt_sync_started(self) -> None:
        raise RuntimeError("observer exploded")

    @hookimpl(tryfirst=True)
    def wt_chunk_moved(self, nbytes: int) -> None:
        raise RuntimeError("observer exploded")

    @hookimpl(tryfirst=True)
    def wt_sync_finished(self) -> None:
        raise RuntimeError("observer exploded")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool("example_file", 2, names=NAMES) as p:
        yield p


def _trainer(pool_client: Any, model: ExampleNet, directory: Path) -> Any:
    from wt_example.trainer import FileTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        FileTrainerInitInfo(str(directory), rank=0), client=pool_client, source=ModuleSource(model)
    )


def test_hooks_see_each_sync_with_counts_and_bytes(pool: WorkerPool, tmp_path: Path) -> None:
    recorder = Recorder()
    register_hooks(recorder)
    model = ExampleNet(seed=4)
    num_params = len(NAMES)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = _trainer(pool.client(), model, tmp_path)
    engine.send_weights()
    model.perturb(1)
    engine.send_weights()
    assert pool.each("digests") == [expected_digests(model)] * 2
    expected: list[tuple[str, dict[str, Any]]] = []
    for sync_id in (1, 2):
        expected += [
            (
                "started",
                dict(
                    backend="example_file",
                    sync_id=sync_id,
                    num_params=num_params,
                    total_bytes=total,
                ),
            ),
            ("chunk", dict(sync_id=sync_id, index=0, num_chunks=1, nbytes=total)),
            (
                "finished",
                dict(
                    sync_id=sync_id, num_params=num_params, total_bytes=total, weight_version=None
                ),
            ),
        ]
    assert recorder.events == expected


def test_a_raising_hook_breaks_neither_the_sync_nor_other_hooks(
    pool: WorkerPool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    register_hooks(recorder)
    register_hooks(Exploding())
    model = ExampleNet(seed=5)
    with caplog.at_level(logging.INFO, logger="weight_transfer"):
        _trainer(pool.client(), model, tmp_path).send_weights()
    assert pool.each("digests") == [expected_digests(model)] * 2
    assert [e for e, _ in recorder.events] == ["started", "chunk", "finished"]
    raised = [r for r in caplog.records if "raised" in r.getMessage()]
    assert {r.getMessage().split(" of ")[0] for r in raised} == {
        "weight_transfer hook wt_sync_started",
        "weight_transfer hook wt_chunk_moved",
        "weight_transfer hook wt_sync_finished",
    }
    # the built-in implementation still logged the sync
    assert any(
        r.getMessage().startswith(f"wt example_file sync 1: {len(NAMES)} params")
        for r in caplog.records
    )


def test_failed_sync_reports_the_error(tmp_path: Path) -> None:
    recorder = Recorder()
    register_hooks(recorder)
    with WorkerPool("example_file", 1, names=NAMES) as failing:
        FanoutClient(failing.addresses).call("set_fail_on", "head.bias")
        engine = _trainer(failing.client(), ExampleNet(seed=6), tmp_path)
        with pytest.raises(WeightSyncRPCError) as err:
            engine.send_weights()
    # the file left the sender before the worker refused it
    assert [e for e, _ in recorder.events] == ["started", "chunk", "failed"]
    failed = recorder.events[2][1]
    assert failed["error"] is err.value
    assert (failed["backend"], failed["sync_id"]) == ("example_file", 1)


HOOK_PLUGIN_SRC = """
from weight_transfer.runtime.hooks import hookimpl

EVENTS = []


@hookimpl
def wt_sync_started(backend, sync_id, num_params, total_bytes):
    EVENTS.append(("started", backend, sync_id, num_params, total_bytes))


@hookimpl
def wt_chunk_moved(index, num_chunks, nbytes):
    EVENTS.append(("chunk", index, num_chunks, nbytes))


@hookimpl
def wt_sync_finished(sync_id, weight_version):
    EVENTS.append(("finished", sync_id, weight_version))


@hookimpl
def wt_sync_failed(sync_id, error):
    EVENTS.append(("failed", sync_id, str(error)))
"""


def test_entry_point_hook_plugins_are_loaded(make_dist: MakeDist, unique: str) -> None:
    module = f"wt_tmp_{unique}_hooks"
    make_dist(
        "wt-hook-plugin",
        "1.2.3",
        entry_points={"weight_transfer.hooks": {f"recorder_{unique}": module}},
        modules={module: HOOK_PLUGIN_SRC},
    )
    pm = plugin_manager()
    assert pm.get_plugin(f"recorder_{unique}") is not None
    assert [d.project_name for _, d in pm.list_plugin_distinfo()] == ["wt-hook-plugin"]
    import sys

    events = sys.modules[module].EVENTS
    with track_sync("probe", 7, num_params=2, total_bytes=10, num_chunks=2) as tracker:
        tracker.weight_version = "v7"
        tracker.started()
        tracker.chunk_moved(4)
        tracker.chunk_moved(6)
    with pytest.raises(KeyError), track_sync("probe", 8, num_params=1, total_bytes=1, num_chunks=1):
        raise KeyError("lost")
    with track_sync("probe", 9, num_params=1, total_bytes=1, num_chunks=1, enabled=False) as quiet:
        quiet.started()
        quiet.chunk_moved(1)
    assert events == [
        ("started", "probe", 7, 2, 10),
        ("chunk", 0, 2, 4),
        ("chunk", 1, 2, 6),
        ("finished", 7, "v7"),
        ("failed", 8, "'lost'"),
    ]


class _Wrapping:
    @hookimpl(wrapper=True)
    def wt_sync_started(self) -> Any:
        return (yield)


class _OldWrapping:
    @hookimpl(hookwrapper=True)
    def wt_sync_finished(self) -> Any:
        yield


@pytest.mark.parametrize("plugin_cls", [_Wrapping, _OldWrapping])
def test_a_wrapper_hook_is_refused_naming_it(plugin_cls: type) -> None:
    plugin = plugin_cls()
    with pytest.raises(ValueError, match=r"hook wt_sync_\w+ of .* is a wrapper"):
        register_hooks(plugin, name="wrapping")
    assert plugin_manager().get_plugin("wrapping") is None  # nothing stays registered


WRAPPER_PLUGIN_SRC = """
from weight_transfer.runtime.hookspecs import hookimpl


@hookimpl(wrapper=True)
def wt_sync_failed(error):
    return (yield)
"""


def test_a_wrapper_hook_from_an_entry_point_is_refused(make_dist: MakeDist, unique: str) -> None:
    module = f"wt_tmp_{unique}_wrap"
    make_dist(
        "wt-wrap-plugin",
        "0.1",
        entry_points={"weight_transfer.hooks": {f"wrap_{unique}": module}},
        modules={module: WRAPPER_PLUGIN_SRC},
    )
    with pytest.raises(ValueError, match=rf"wt_sync_failed of 'wrap_{unique}' is a wrapper"):
        plugin_manager()


def test_tracker_finish_and_fail_are_explicit_and_end_it_once() -> None:
    recorder = Recorder()
    register_hooks(recorder)
    from weight_transfer.runtime.hooks import SyncTracker

    tracker = SyncTracker("probe", 3, num_params=1, total_bytes=8, num_chunks=1)
    tracker.started()
    tracker.weight_version = "v3"
    tracker.finish()
    tracker.fail(RuntimeError("too late"))  # ignored: the round already ended
    tracker.finish()
    failing = SyncTracker("probe", 4, num_params=1, total_bytes=8, num_chunks=1)
    failing.fail(RuntimeError("lost"))
    failing.finish()
    kinds = [(e, d.get("sync_id")) for e, d in recorder.events]
    assert kinds == [("started", 3), ("finished", 3), ("failed", 4)]
    assert recorder.events[1][1]["weight_version"] == "v3"
