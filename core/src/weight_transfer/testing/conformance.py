"""The conformance suite: what every backend must do, checked on real worker processes.

Run by `weight_transfer.testing.plugin` over the profiles it is given (or by
any conftest that parametrizes `wt_profile`). The trainer runs in the test
process; `WORKERS` worker processes hold a `ConformanceModel` and create
their engine through the factory. Every check compares the workers' weights
bit for bit with what the test computed, and every test begins with a round
of known weights, so the tests of one profile share its workers.

Checked: bit-exact rounds in every wire mode; a failing worker (named, every
worker rolled back, the next round works); a source that disagrees with its
metadata (the parameter named, rolled back); a source written as vLLM 0.33
writes one (cached `metadata`, `iter_full`); a full-resync round's tensors
handed over on the call, whole or in chunks (all or nothing); a round aborted
in band and one left open; a killed worker (the round fails within the timeout, the restarted
worker is re-admitted); one trainer per engine; re-admission of an engine
that was shut down.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weight_transfer.factory import WeightTransferTrainerFactory
from weight_transfer.resync import ResyncTrainerEngine
from weight_transfer.runtime.sources import StreamedSource
from weight_transfer.source import WeightSource
from weight_transfer.testing.models import (
    DISAGREEMENTS,
    DisagreeingSource,
    Source033,
    TensorSource,
    conformance_weights,
)
from weight_transfer.testing.profile import Profile, Sender
from weight_transfer.testing.workers import WorkerPool, digest

WORKERS = 2
TIMEOUT_S = 20.0
MODEL = "weight_transfer.testing.models:conformance_model"


def fingerprints(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest(tensor) for name, tensor in weights.items()}


def assert_holds(
    pool: WorkerPool,
    weights: dict[str, torch.Tensor],
    what: str,
    *,
    within_s: float = 0.0,
    ranks: list[int] | None = None,
) -> None:
    """Every worker of `pool` (or `ranks`) holds `weights` bit for bit, now or, with
    `within_s`, at some point within that many seconds (a worker whose round the
    trainer abandoned on a failure rolls it back on its own time)."""
    want = fingerprints(weights)
    deadline = time.monotonic() + within_s
    for rank in range(len(pool.addresses)) if ranks is None else ranks:
        while True:
            got = pool.on(rank, "weights")
            wrong = sorted(name for name in want if got.get(name) != want[name])
            if not wrong:
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what}: worker {rank} differs in {wrong[:3]} ({len(wrong)} in all)"
                )
            time.sleep(0.1)


class SentBy:
    """The trainer engine of a backend that takes no `WeightSource`, driven as one
    that does: `send_weights()` is the profile's round (`Profile.send`) for the
    current tensors of `source`. Every other attribute is the engine's."""

    def __init__(self, engine: Any, send: Sender) -> None:
        self.engine = engine
        self.send = send
        self.source: TensorSource | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def send_weights(self) -> None:
        assert self.source is not None
        self.send(self.engine, dict(self.source.tensors))


class Trainers:
    """Trainer engines of one test, all shut down at its end."""

    def __init__(self, profile: Profile, pool: WorkerPool) -> None:
        self.profile = profile
        self.pool = pool
        self.engines: list[Any] = []
        self._dirs: list[tempfile.TemporaryDirectory[str]] = []

    def start(
        self,
        source: WeightSource,
        *,
        wire: dict[str, Any] | None = None,
        replace: bool = False,
        timeout_s: float = TIMEOUT_S,
    ) -> Any:
        workdir = tempfile.TemporaryDirectory(prefix="wt-conformance-")
        self._dirs.append(workdir)
        info = self.profile.trainer_info(
            workers=WORKERS,
            wire=dict(wire or {}),
            timeout_s=timeout_s,
            replace=replace,
            workdir=workdir.name,
        )
        client = self.pool.client(timeout_s=timeout_s + 10)
        send = self.profile.send
        engine: Any
        if send is None:
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        else:
            engine = SentBy(WeightTransferTrainerFactory.trainer_init(info, client=client), send)
            engine.source = source
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            with contextlib.suppress(Exception):  # a test that failed may leave it broken
                engine.shutdown()
        for workdir in self._dirs:
            workdir.cleanup()


@pytest.fixture(scope="module")
def wt_pool(wt_profile: Profile) -> Iterator[WorkerPool]:
    with WorkerPool(
        wt_profile.backend,
        WORKERS,
        model_factory=MODEL,
        sys_path=list(wt_profile.sys_path),
        in_process=wt_profile.in_process,
    ) as pool:
        yield pool


@pytest.fixture
def trainers(wt_profile: Profile, wt_pool: WorkerPool) -> Iterator[Trainers]:
    wt_pool.each("set_fail_on", None)
    wt_pool.each("set_load_delay", 0.0)
    made = Trainers(wt_profile, wt_pool)
    yield made
    made.close()


def _synced(trainers: Trainers, seed: int, **options: Any) -> tuple[Any, TensorSource]:
    """A trainer whose first round moved `conformance_weights(seed)`, checked."""
    source = TensorSource(conformance_weights(seed))
    engine = trainers.start(source, **options)
    engine.send_weights()
    assert_holds(trainers.pool, source.tensors, f"the first round ({trainers.profile})")
    return engine, source


def test_rounds_are_bit_exact_in_every_wire_mode(wt_profile: Profile, trainers: Trainers) -> None:
    for mode, wire in wt_profile.wire_modes.items():
        engine, source = _synced(trainers, 0, wire=dict(wire))
        for round_ in range(1, 3):
            source.set(conformance_weights(round_ + 10))
            engine.send_weights()
            assert_holds(trainers.pool, source.tensors, f"wire mode {mode!r}, round {round_}")
        engine.shutdown()


def test_a_failing_worker_is_named_and_every_worker_keeps_its_weights(
    wt_profile: Profile, trainers: Trainers
) -> None:
    if not wt_profile.loads_by_name:
        pytest.skip(f"{wt_profile} does not load through the model by name: no load to fail")
    engine, source = _synced(trainers, 1)
    before = {n: t.clone() for n, t in source.tensors.items()}
    names = list(before)
    failing = names[len(names) // 2]
    trainers.pool.on(1, "set_fail_on", failing)
    source.set(conformance_weights(2))
    with pytest.raises(Exception) as error:
        engine.send_weights()
    message = str(error.value)
    assert failing in message and "worker 1" in message, message
    assert_holds(trainers.pool, before, "after a worker failed mid-round", within_s=TIMEOUT_S)
    trainers.pool.each("set_fail_on", None)
    engine.send_weights()
    assert_holds(trainers.pool, source.tensors, "the round after a failed one")


def test_a_source_disagreeing_with_its_metadata_is_refused_naming_the_parameter(
    wt_profile: Profile, trainers: Trainers
) -> None:
    if not wt_profile.takes_source:
        pytest.skip(f"{wt_profile} takes no WeightSource")
    tensors = conformance_weights(3)
    names = list(tensors)
    source = DisagreeingSource(tensors)
    engine = trainers.start(source)
    engine.send_weights()
    before = {n: t.clone() for n, t in tensors.items()}
    source.set(conformance_weights(4))
    source.at = 4
    for how in DISAGREEMENTS:
        source.how = how
        with pytest.raises(ValueError) as error:
            engine.send_weights()
        expected = "surplus.weight" if how == "extra" else names[4]
        assert expected in str(error.value), f"{how}: {error.value}"
        assert_holds(
            trainers.pool, before, f"after a source that disagreed ({how})", within_s=TIMEOUT_S
        )
    source.how = None
    engine.send_weights()
    assert_holds(trainers.pool, tensors, "the round after a disagreeing source")


def test_a_source_written_as_vllm_033_writes_one_syncs_bit_exactly(
    wt_profile: Profile, trainers: Trainers
) -> None:
    """A cached `metadata` and `iter_full()` (vLLM 0.33's way): bit-exact rounds, and a
    disagreement named and rolled back as wt's way of writing a source gets."""
    if not wt_profile.takes_source:
        pytest.skip(f"{wt_profile} takes no WeightSource")
    tensors = conformance_weights(8)
    names = list(tensors)
    source = Source033(tensors)
    engine = trainers.start(source)
    engine.send_weights()
    assert_holds(trainers.pool, tensors, "the first round of a vLLM 0.33-style source")
    before = {n: t.clone() for n, t in tensors.items()}
    source.set(conformance_weights(9))
    source.how, source.at = "reshape", 4
    with pytest.raises(ValueError) as error:
        engine.send_weights()
    assert names[4] in str(error.value), error.value
    assert_holds(trainers.pool, before, "after a 0.33-style source disagreed", within_s=TIMEOUT_S)
    source.how = None
    engine.send_weights()
    assert_holds(trainers.pool, tensors, "the round after a 0.33-style source disagreed")


def _streamed(tensors: dict[str, torch.Tensor], names: list[str], fail_at: str = "") -> Any:
    """`names` of `tensors` handed over on the call, metadata as `(name, dtype, shape)`;
    drawing `fail_at` raises (a framework failing while it hands tensors over)."""

    def pairs() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            if name == fail_at:
                raise RuntimeError(f"conformance: the framework failed at {name}")
            yield name, tensors[name]

    metadata = [(n, str(tensors[n].dtype), list(tensors[n].shape)) for n in names]
    return StreamedSource(metadata, pairs())


def test_a_round_handed_over_on_the_call_whole_or_in_chunks_is_all_or_nothing(
    wt_profile: Profile, trainers: Trainers
) -> None:
    """An engine built without a source: a round from `send_weights(source=...)`,
    then one of two chunks between `begin()` and `end()`, each bit-exact; a round
    whose second chunk fails, and one aborted after its first, leave every worker
    on the weights before it; the next round works."""
    engine_class = WeightTransferTrainerFactory.get_engine_class(wt_profile.backend)
    if not wt_profile.takes_source or not issubclass(engine_class, ResyncTrainerEngine):
        pytest.skip(f"{wt_profile} is not a full-resync engine of a WeightSource")
    engine = trainers.start(None)  # type: ignore[arg-type]  # every round names its source
    pool = trainers.pool
    tensors = conformance_weights(12)
    names = list(tensors)
    half = len(names) // 2
    engine.send_weights(source=_streamed(tensors, names))
    assert_holds(pool, tensors, "a round handed over on the call")
    tensors = conformance_weights(13)
    engine.begin()
    engine.send_weight_chunk(_streamed(tensors, names[:half]))
    engine.send_weight_chunk(_streamed(tensors, names[half:]))
    engine.end("chunked")
    assert_holds(pool, tensors, "a round of two chunks")
    before, tensors = tensors, conformance_weights(14)
    engine.begin()
    engine.send_weight_chunk(_streamed(tensors, names[:half]))
    with pytest.raises(RuntimeError, match="the framework failed"):
        engine.send_weight_chunk(_streamed(tensors, names[half:], fail_at=names[-1]))
    assert_holds(pool, before, "after the second chunk failed", within_s=TIMEOUT_S)
    engine.begin()
    engine.send_weight_chunk(_streamed(tensors, names[:half]))
    engine.abort("conformance: the framework gave the round up")
    assert_holds(pool, before, "after a round of chunks was aborted", within_s=TIMEOUT_S)
    engine.send_weights(source=_streamed(tensors, names))
    assert_holds(pool, tensors, "the round after")


def test_a_round_aborted_in_band_or_left_open_changes_nothing_and_the_next_round_works(
    trainers: Trainers,
) -> None:
    engine, source = _synced(trainers, 5)
    before = {n: t.clone() for n, t in source.tensors.items()}
    engine.client.start_weight_update()
    engine.client.abort_round("conformance: the trainer gave the round up")
    assert_holds(trainers.pool, before, "after a round aborted in band", within_s=TIMEOUT_S)
    source.set(conformance_weights(6))
    engine.send_weights()
    assert_holds(trainers.pool, source.tensors, "the round after an aborted one")
    engine.client.start_weight_update()  # and never finished: left open
    source.set(conformance_weights(7))
    engine.send_weights()
    assert_holds(trainers.pool, source.tensors, "the round after one left open")


def test_a_killed_worker_fails_the_round_in_time_and_its_restart_is_readmitted(
    wt_profile: Profile, trainers: Trainers
) -> None:
    if wt_profile.in_process:
        pytest.skip(f"{wt_profile}'s workers are threads of this process: none can be killed")
    timeout_s = 10.0
    engine, source = _synced(trainers, 8, timeout_s=timeout_s)
    before = {n: t.clone() for n, t in source.tensors.items()}
    pool = trainers.pool
    source.set(conformance_weights(9))
    if wt_profile.loads_by_name:  # killed mid-round: each load of the round takes 0.5 s
        pool.each("set_load_delay", 0.5)
        killer = threading.Timer(0.3, pool.kill, args=(1,))
    else:  # no load to slow down: killed before the round
        pool.kill(1)
        killer = threading.Timer(0.0, lambda: None)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - each backend names the loss its own way
        engine.send_weights()
    elapsed = time.monotonic() - t0
    killer.join()
    assert elapsed < timeout_s + 10, f"the round failed only after {elapsed:.1f}s"
    # the survivor rolls back, at the latest when its watchdog sees the round stall
    assert_holds(pool, before, "the surviving worker", within_s=2 * timeout_s, ranks=[0])
    pool.restart(1)
    pool.each("set_load_delay", 0.0)
    engine.send_weights()
    assert_holds(pool, source.tensors, "the round after a worker was restarted")


def test_one_trainer_per_engine_unless_the_new_one_replaces_it(
    wt_profile: Profile, trainers: Trainers
) -> None:
    first, source = _synced(trainers, 11)
    if wt_profile.knows_liveness:
        with pytest.raises(Exception) as refused:
            trainers.start(TensorSource(conformance_weights(12)))
        message = str(refused.value)
        assert f"serves trainer {first.trainer_id}" in message, message
        assert "replace_trainer=True" in message, message
        source.set(conformance_weights(13))
        first.send_weights()  # the refusal changed nothing for the trainer served
        assert_holds(trainers.pool, source.tensors, "the first trainer after a refused second")
    second, second_source = _synced(trainers, 14, replace=True)
    with pytest.raises(Exception, match=f"serves trainer {second.trainer_id}"):
        first.send_weights()  # refused by its key, or by a re-admission the holder refuses
    assert_holds(trainers.pool, second_source.tensors, "after the replaced trainer tried again")


def test_an_engine_shut_down_is_readmitted_at_the_next_round(trainers: Trainers) -> None:
    engine, source = _synced(trainers, 15)
    trainers.pool.on(0, "shutdown_weight_transfer_engine")
    source.set(conformance_weights(16))
    engine.send_weights()
    assert_holds(trainers.pool, source.tensors, "the round after worker 0 shut its engine down")
