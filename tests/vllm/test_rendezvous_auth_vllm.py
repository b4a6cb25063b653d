"""A stray process races a live vLLM engine's init for its rank and cannot take it.

The stray (`tests/stray.py`, a real OS process on 127.0.0.1) claims the
engine's worker rank on the trainer's store port, with a proof made without
the secret, after the trainer started listening and before the engine's init
call leaves. The trainer refuses and logs it; the engine still joins, syncs,
and then generates exactly what a fresh engine loaded from the target
checkpoint generates.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.stray import Stray
from tests.vllm.conftest import References, ServedEngines, connect, generate

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class _RacingClient:
    """Forwards to `inner`; before each init, a stray claims rank 1 on the payload's port."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stray_saw: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        with Stray("claim", init_info["master_address"], init_info["master_port"], 1) as stray:
            self.stray_saw.append(stray.line("connected"))
            self.stray_saw.append(stray.line("verdict"))
            self.stray_saw.append(stray.line("after"))
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)


def test_a_stray_racing_the_engines_init_is_refused_and_the_engine_syncs_exactly(
    served: ServedEngines, references: References, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="weight_transfer")
    engine = served("nccl")
    racing = _RacingClient(engine.client)
    engine.trainer.shutdown()
    try:
        engine.trainer = connect("nccl", racing, engine.source, engine.scratch)
        peer, verdict, after = racing.stray_saw
        assert verdict.startswith("01") and after == "CLOSED"
        refusals = [r.getMessage() for r in caplog.records if "bad secret" in r.getMessage()]
        assert refusals and peer in refusals[0] and "claimed rank 1" in refusals[0]

        seed = 3 if engine.seed == 2 else 2
        engine.sync(seed, version="after-the-stray")
        assert generate(engine.llm) == references.outputs(seed)
        assert engine.llm.get_weight_version() == "after-the-stray"
    finally:
        engine.reconnect()  # the next test gets a trainer without the racing client
