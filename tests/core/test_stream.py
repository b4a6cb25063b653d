"""Core's streaming pieces on their own: `SendWindow`, `LoadPipeline`, `GroupChannel`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from weight_transfer.backend import AlignedFailure, Transfer
from weight_transfer.runtime.control import ChannelDownError
from weight_transfer.runtime.hooks import SyncTracker
from weight_transfer.runtime.waiting import CollectiveError, TransferTimeout
from wt_kits.channel import GroupChannel
from wt_kits.group import StatelessGroup, free_port
from wt_kits.group.auth import new_secret
from wt_kits.stream import LoadFailed, LoadPipeline, RotatingBuffers, SendWindow


def _transfer(watch: dict[str, Future[None]] | None = None, timeout_s: float = 5.0) -> Transfer:
    return Transfer(timeout_s, SyncTracker("t", 1, 0, 0, 0, enabled=False), watch or {})


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


def _later(delay_s: float, error: BaseException | None = None) -> Future[None]:
    f: Future[None] = Future()

    def finish() -> None:
        if error is None:
            f.set_result(None)
        else:
            f.set_exception(error)

    threading.Timer(delay_s, finish).start()
    return f


# ---------------------------------------------------------------- SendWindow


def test_send_window_reuses_a_buffer_only_after_its_sends_completed() -> None:
    window = SendWindow(RotatingBuffers(2, "cpu"), _transfer())
    b0 = window.buffer(0, 16)
    window.sent(0, [_later(0.3)], [b0])
    b1 = window.buffer(1, 16)  # the other slot: no wait
    assert b1.data_ptr() != b0.data_ptr()
    window.sent(1, [_done()], [b1])
    t0 = time.monotonic()
    b2 = window.buffer(2, 16)  # slot 0 again: waits for bucket 0's send
    assert time.monotonic() - t0 >= 0.25
    assert b2.data_ptr() == b0.data_ptr()
    window.drain()


def test_send_window_a_worker_error_with_every_send_completed_is_aligned() -> None:
    refused: Future[None] = Future()
    refused.set_exception(ValueError("worker 0: no parameter named 'x'"))
    window = SendWindow(RotatingBuffers(2, "cpu"), _transfer({"update": refused}))
    window.sent(0, [_done()], [])
    window.sent(1, [Future()], [])  # still in flight: the watched failure wins at once
    with pytest.raises(ValueError, match="no parameter named"):  # not aligned: 1 is pending
        window.buffer(3, 8)
    window = SendWindow(RotatingBuffers(1, "cpu"), _transfer({"update": refused}))
    window.sent(0, [_later(0.1)], [])
    with pytest.raises(AlignedFailure) as err:
        window.buffer(1, 8)
    assert isinstance(err.value.error, ValueError)


def test_send_window_times_out_naming_the_bucket() -> None:
    window = SendWindow(RotatingBuffers(2, "cpu"), _transfer(timeout_s=0.2))
    window.sent(0, [Future()], [])
    with pytest.raises(TransferTimeout, match="the sends of bucket 0 did not complete"):
        window.buffer(2, 8)


# -------------------------------------------------------------- LoadPipeline


def test_load_pipeline_lag_and_horizon_follow_the_buffer_count() -> None:
    shapes = [(n, LoadPipeline(lambda b: None, n, 1.0, name="t")) for n in (1, 2, 3, 4)]
    assert [(p.lag, p.horizon) for _, p in shapes] == [(1, 0), (2, 0), (2, 1), (2, 2)]
    for _, p in shapes:
        p.close()


def test_load_pipeline_loads_in_order_beside_the_receive_loop() -> None:
    loaded: list[str] = []
    started = threading.Event()

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        started.set()
        time.sleep(0.05)
        loaded.extend(n for n, _ in batch)

    pipeline = LoadPipeline(load, 2, 5.0, name="wt-test-load")
    try:
        for k in range(5):
            pipeline.before_receive(k)
            pipeline.submit([(f"p{k}", torch.zeros(1))])
            if k == 0:
                assert started.wait(5)
                assert loaded == []  # the receive loop went on while bucket 0 loads
        pipeline.finish()
    finally:
        pipeline.close()
    assert loaded == [f"p{k}" for k in range(5)]


def test_load_pipeline_drains_after_a_failure_and_finish_raises() -> None:
    loaded: list[int] = []

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        k = int(batch[0][0])
        if k == 1:
            raise KeyError("no parameter named '1'")
        time.sleep(0.02)
        loaded.append(k)

    pipeline = LoadPipeline(load, 2, 5.0, name="wt-test-load")
    try:
        for k in range(6):
            pipeline.before_receive(k)
            if not pipeline.draining:
                pipeline.submit([(str(k), torch.zeros(1))])
        assert pipeline.draining
        with pytest.raises(LoadFailed, match="no parameter named '1'"):
            pipeline.finish()
    finally:
        pipeline.close()
    assert 1 not in loaded and all(k < 4 for k in loaded)  # nothing loads after the drain began


# --------------------------------------------------------------- GroupChannel


def _solo_group() -> StatelessGroup:
    return StatelessGroup.create(
        host="127.0.0.1", port=free_port(), rank=0, world_size=1, secret=new_secret(), timeout_s=10
    )


def test_group_channel_says_why_it_has_no_group() -> None:
    channel = GroupChannel("demo", remedy="run trainer_init again")
    with pytest.raises(
        ChannelDownError, match=r"demo: no transfer group \(it has not been connected"
    ):
        channel.require()
    channel.connect(_solo_group())
    assert channel.connected

    # inside the wire block anything but an aligned failure may have left the
    # collectives out of step
    with pytest.raises(ValueError), channel.on_wire("a batch"):
        raise ValueError("refused")
    assert not channel.connected
    with pytest.raises(ChannelDownError, match=r"torn down after a batch failed \(ValueError"):
        channel.require()


def test_group_channel_keeps_the_group_after_an_aligned_failure_and_closes_cleanly() -> None:
    channel = GroupChannel("demo", remedy="run trainer_init again")
    channel.connect(_solo_group())
    with pytest.raises(AlignedFailure), channel.on_wire("a round"):
        raise AlignedFailure(RuntimeError("the trainer aborted"))
    group = channel.require()
    work = group.broadcast(torch.ones(3))
    work.wait()  # still usable
    with pytest.raises(CollectiveError), channel.on_wire("a broadcast"):
        raise CollectiveError("a peer process died")
    with pytest.raises(ChannelDownError, match="torn down after a broadcast failed"):
        channel.require()
    channel.connect(_solo_group())
    channel.close()
    with pytest.raises(ChannelDownError, match="the engine was shut down"):
        channel.require()
