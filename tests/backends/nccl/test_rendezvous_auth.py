"""wt-nccl's group admits only workers holding the secret of its init payload.

A real stray process on 127.0.0.1 (`tests/stray.py`) races the rendezvous
claiming the worker's rank, or takes the trainer's place on the port; the
worker engines are real processes (`WorkerPool`).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.harness import RecordingClient, WorkerPool, digest
from tests.sources import DictSource, mixed_tensors
from tests.stray import Stray
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from weight_transfer.payload import WIRE_PROTOCOL_VERSION
from wt_kits.group import free_port
from wt_nccl import NCCLTrainerInitInfo


def _info(port: int) -> NCCLTrainerInitInfo:
    return NCCLTrainerInitInfo("127.0.0.1", port, 2, rank=0, timeout_s=30.0)


def test_a_stray_racing_the_init_for_the_workers_rank_is_refused_and_the_sync_is_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    tensors = mixed_tensors(5)
    port = free_port()
    verdicts: list[str] = []

    def race(payload: dict[str, Any]) -> None:  # before the worker's init leaves
        with Stray("claim", "127.0.0.1", payload["master_port"], 1) as stray:
            stray.line("connected")
            verdicts.append(stray.line("verdict"))
            verdicts.append(stray.line("after"))

    with WorkerPool("nccl", 1, names=list(tensors)) as pool:
        client = RecordingClient(pool.client(), on_init=race)
        engine = WeightTransferTrainerFactory.trainer_init(
            _info(port), client=client, source=DictSource(tensors)
        )
        try:
            assert verdicts[0].startswith("01") and verdicts[1] == "CLOSED"
            refusals = [r.getMessage() for r in caplog.records if "bad secret" in r.getMessage()]
            assert refusals and "claimed rank 1" in refusals[0]
            engine.send_weights()
            assert pool.each("digests") == [{n: digest(t) for n, t in tensors.items()}]
        finally:
            engine.shutdown()


def test_a_worker_pointed_at_a_stray_server_refuses_it_and_loads_nothing() -> None:
    tensors = mixed_tensors(4)
    port = free_port()
    fields = _info(port).worker_group_fields("some-trainer")
    wire = {"wire_protocol": WIRE_PROTOCOL_VERSION, **fields}
    with WorkerPool("nccl", 1, names=list(tensors)) as pool:
        with Stray("server", "127.0.0.1", port) as stray:
            stray.line("listening")
            with pytest.raises(WeightSyncRPCError, match=rf"127\.0\.0\.1:{port}.*did not prove"):
                pool.client(timeout_s=30.0).init_weight_transfer_engine(wire)
            assert stray.line("no-proof", timeout_s=10.0) == ""
        assert pool.each("digests") == [{}]  # nothing was loaded

        engine = WeightTransferTrainerFactory.trainer_init(
            _info(free_port()), client=pool.client(), source=DictSource(tensors)
        )
        try:
            engine.send_weights()
            assert pool.each("digests") == [{n: digest(t) for n, t in tensors.items()}]
        finally:
            engine.shutdown()
