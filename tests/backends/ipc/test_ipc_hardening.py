"""wt-ipc against handshakes and attachments gone wrong, with real worker processes.

- A handshake whose staging entries repeat, reorder or substitute the trainer's own
  buffers (right owner, mode and size), or misstate the wire parameters, is refused at
  init naming the entry; nothing is loaded.
- A refused init leaves the working attachment exactly as it was.
- A worker that was killed and restarted, or whose link closed, or a fresh engine behind
  the client, is attached again at the next `send_weights`, which lands bit-exactly.
- A worker that refuses an update ends the round on every worker at once, links intact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.backends.ipc.helpers import (
    FreshClient,
    Tampering,
    mapped_segments,
    our_segments,
    start_worker,
)
from tests.backends.ipc.models import BIG
from tests.harness import FanoutClient, WorkerPool, digest, ipc_trainer, weights
from tests.sources import DictSource, mixed_tensors
from weight_transfer import WeightSyncRPCError
from wt_ipc.planes import TrainerStaging
from wt_ipc.protocol import StagingSeal
from wt_kits.colocated import SharedSegment
from wt_kits.stream import WireParams

MODEL = "tests.backends.ipc.models:mixed_model"
BUFFER = 4096


def connect(pool: WorkerPool, source: Any, client: Any, **wire: Any) -> Any:
    return ipc_trainer(pool, source, client, **{"packed_buffer_size_bytes": BUFFER, **wire})


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: digest(t) for n, t in tensors.items()}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool("ipc", 1, model_factory=MODEL) as p:
        yield p


# --- staging entries bound to their order, their staging and the wire parameters


@pytest.fixture
def other_staging() -> Iterator[TrainerStaging]:
    """Another staging of this very process, of the same sizes (another engine's, say)."""
    seal = StagingSeal(WireParams(packed_buffer_size_bytes=BUFFER), "another-engine", 12345)
    staging = TrainerStaging.create("shm", 2, BUFFER, torch.device("cpu"), 1, seal=seal)
    yield staging
    staging.close()


def _names(payload: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {**payload, "segment_names": names}


def _second(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """`payload` with `name` in place of its second staging entry."""
    return _names(payload, [payload["segment_names"][0], name])


def _unsealed_twin(name: str, keep: list[SharedSegment]) -> str:
    """A segment of this process as large as `name`, holding no seal."""
    twin = SharedSegment.create(os.stat(f"/dev/shm/{name}").st_size)
    keep.append(twin)
    return twin.name


STAGING_CASES = [
    "repeated",
    "swapped",
    "unsealed",
    "other-staging",
    "buffer-size",
    "min-bucket",
    "trainer-id",
]


@pytest.mark.parametrize("case", STAGING_CASES)
def test_repeated_reordered_or_foreign_staging_is_refused_at_init_naming_the_entry(
    pool: WorkerPool, case: str, other_staging: TrainerStaging
) -> None:
    keep: list[SharedSegment] = []
    foreign = other_staging.fields()["segment_names"]
    rewrites: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
        "repeated": (
            lambda p: _names(p, [p["segment_names"][0]] * 2),
            r"'segment_names\[1\]' repeats 'segment_names\[0\]'",
        ),
        "swapped": (
            lambda p: _names(p, p["segment_names"][::-1]),
            r"'segment_names\[0\]': the buffer is staging buffer 1, not 0",
        ),
        "unsealed": (
            lambda p: _second(p, _unsealed_twin(p["segment_names"][1], keep)),
            r"'segment_names\[1\]': the buffer carries no wt staging seal",
        ),
        "other-staging": (
            lambda p: _second(p, foreign[1]),
            r"'segment_names\[1\]': the buffer belongs to another staging",
        ),
        "buffer-size": (
            lambda p: {**p, "packed_buffer_size_bytes": BUFFER // 2},
            rf"'packed_buffer_size_bytes' is {BUFFER // 2}, but the trainer made the staging "
            rf"with {BUFFER} \(the seal of segment_names\[0\]\)",
        ),
        "min-bucket": (
            lambda p: {**p, "packed_min_bucket_bytes": 0},
            r"'packed_min_bucket_bytes' is 0, but the trainer made the staging with",
        ),
        "trainer-id": (
            lambda p: {**p, "trainer_id": "somebody-else"},
            r"'trainer_id' is not the trainer that made the staging",
        ),
    }
    rewrite, match = rewrites[case]
    before = weights(pool)
    tensors = mixed_tensors(4, big_numel=BIG)
    client = Tampering(pool.client(), init=rewrite)
    accepted = []
    try:
        with pytest.raises(WeightSyncRPCError, match=match):
            accepted.append(connect(pool, DictSource(tensors), client))
    finally:
        for engine in accepted:  # it should not have been
            engine.shutdown()
        for segment in keep:
            segment.close()
    assert [s for s in our_segments(os.getpid()) if s not in foreign] == []
    assert weights(pool) == before  # nothing loaded
    offered = {*client.handshakes[0]["segment_names"], *foreign, *(s.name for s in keep)}
    assert offered.isdisjoint(mapped_segments(pool.processes[0].pid))  # nor left mapped
    engine = connect(pool, DictSource(tensors), pool.client())  # the worker is as good as new
    engine.send_weights()
    assert weights(pool) == [fingerprints(tensors)]
    engine.shutdown()


# --- a refused init leaves the attachment as it was


REINITS = ["replayed", "replayed-malformed", "takeover-swapped"]


@pytest.mark.parametrize("case", REINITS)
def test_a_refused_init_leaves_the_working_attachment_as_it_was(
    pool: WorkerPool, case: str
) -> None:
    client = Tampering(pool.client())
    engine = connect(pool, DictSource(mixed_tensors(1, big_numel=BIG)), client)
    engine.send_weights()
    (own,) = client.handshakes
    worker_pid = pool.processes[0].pid
    attached = mapped_segments(worker_pid)
    assert attached == set(own["segment_names"])
    intruder = None
    try:
        with pytest.raises(WeightSyncRPCError) as refused:
            if case == "replayed":
                pool.client().init_weight_transfer_engine(own)
            elif case == "replayed-malformed":
                pool.client().init_weight_transfer_engine({**own, "trainer_pid": 1})
            else:  # a live takeover whose handshake swaps the staging entries
                swap = Tampering(pool.client(), init=lambda p: _names(p, p["segment_names"][::-1]))
                intruder = connect(
                    pool, DictSource(mixed_tensors(2, big_numel=BIG)), swap, replace_trainer=True
                )
        if case == "takeover-swapped":
            assert "segment_names[0]" in str(refused.value)
        else:
            assert "could not reach the trainer's control socket" in str(refused.value)
        assert mapped_segments(worker_pid) == attached
        target = mixed_tensors(3, big_numel=BIG)
        engine.source = DictSource(target)
        engine.send_weights()  # on the attachment the worker had
        assert weights(pool) == [fingerprints(target)]
        assert len(client.handshakes) == 1  # no re-attachment was needed
        assert mapped_segments(worker_pid) == attached
    finally:
        if intruder is not None:
            intruder.shutdown()
        engine.shutdown()
    assert our_segments(os.getpid()) == []


# --- re-admission: restarted workers, closed links, a fresh engine behind the client


def test_a_fresh_engine_refuses_a_start_with_no_group_and_is_readmitted() -> None:
    """The trainer's link to the old process is intact, so only the fresh engine's
    refusal of the start (core's `Refusal.NO_CONNECTION`) can tell the trainer to attach again."""
    with WorkerPool("ipc", 1, model_factory=MODEL) as p:
        client = Tampering(FreshClient(p))
        engine = connect(p, DictSource(mixed_tensors(1, big_numel=BIG)), client)
        engine.send_weights()
        old = start_worker(p, 0, MODEL)  # the old engine lives on, still attached
        p.processes.append(old)  # stopped with the pool
        with pytest.raises(WeightSyncRPCError, match=r"no transfer group \(it has not been"):
            FanoutClient(list(p.addresses)).start_weight_update()
        target = mixed_tensors(2, big_numel=BIG)
        engine.source = DictSource(target)
        engine.send_weights()
        assert weights(p)[0] == fingerprints(target)
        assert len(client.handshakes) == 2
        engine.shutdown()
        assert our_segments(os.getpid()) == []


# --- one worker refuses an update: the others end the round at once, links intact


def test_a_worker_refusing_an_update_ends_the_round_on_every_worker_at_once() -> None:
    first = mixed_tensors(1, big_numel=BIG)

    def stale_for_worker_1(update: Any) -> Any:
        return [update, {**update, "round_id": 0}]  # a per-worker list: worker 1 refuses

    with WorkerPool("ipc", 2, model_factory=MODEL) as p:
        client = Tampering(p.client())
        engine = connect(
            p, DictSource(first), client, packed_buffer_size_bytes=1024,
            packed_min_bucket_bytes=0,
        )  # fmt: skip
        engine.send_weights()
        client.update = stale_for_worker_1
        engine.source = DictSource(mixed_tensors(2, big_numel=BIG))
        t0 = time.monotonic()
        with pytest.raises(WeightSyncRPCError, match=r"worker 1: .*'round_id' is 0"):
            engine.send_weights()
        client.update = None
        target = mixed_tensors(3, big_numel=BIG)
        engine.source = DictSource(target)
        engine.send_weights()  # worker 0 ended its round on the trainer's ABORT
        elapsed = time.monotonic() - t0
        assert elapsed < 15, f"the round ended on worker 0 only after {elapsed:.1f}s"
        assert weights(p) == [fingerprints(target)] * 2
        assert len(client.handshakes) == 1  # both links carried the next round
        engine.shutdown()
