"""wt-ipc on CPU (shared memory): a trainer (this process or a spawned one) and real
worker processes that load from views into its segments."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.backends.ipc.helpers import Tampering, our_segments
from tests.backends.ipc.models import BIG
from tests.harness import (
    ForbiddenClient,
    RecordingClient,
    WorkerPool,
    assert_received,
    digest,
    ipc_trainer,
)
from tests.sources import (
    DictSource,
    StallingSource,
    dtensor_model,
    mixed_tensors,
)
from weight_transfer import WeightSyncRPCError, WeightTransferTrainerFactory
from wt_ipc import IPCTrainerInitInfo
from wt_ipc.protocol import SEAL_BYTES
from wt_kits.colocated import SharedSegment
from wt_kits.group import free_port

WORKERS = 2
MODEL = "tests.backends.ipc.models:mixed_model"


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool("ipc", WORKERS) as p:
        yield p


connect = ipc_trainer


def test_tensor_larger_than_a_buffer_is_split_and_reassembled(pool: WorkerPool) -> None:
    big = torch.randn(10_000, generator=torch.Generator().manual_seed(3))  # 40 KB
    tensors = {"a.weight": torch.arange(5, dtype=torch.int16), "b.weight": big}
    pool.each("set_names", list(tensors))
    engine = connect(pool, DictSource(tensors), packed_buffer_size_bytes=4096)
    assert engine.num_chunks(DictSource(tensors).metadata()) >= 10
    engine.send_weights()
    assert_received(pool, tensors)
    engine.shutdown()


def test_payloads_are_json_and_segments_private_and_unlinked_once_attached(
    pool: WorkerPool,
) -> None:
    seen: dict[str, tuple[int, int]] = {}

    def inspect(payload: dict[str, Any]) -> None:
        for name in payload["segment_names"]:
            info = os.stat(f"/dev/shm/{name}")
            seen[name] = (stat.S_IMODE(info.st_mode), info.st_size)

    tensors = mixed_tensors(4)
    pool.each("set_names", list(tensors))
    client = RecordingClient(pool.client(), on_init=inspect)
    engine = connect(pool, DictSource(tensors), client, packed_buffer_size_bytes=8192)
    assert len(seen) == 2
    for name, (mode, size) in seen.items():
        assert name.startswith(f"wt-{os.getpid()}-") and len(name.split("-")[2]) == 32
        assert (mode, size) == (0o600, SEAL_BYTES + 8192)  # the seal, then the buffer
    assert our_segments(os.getpid()) == []  # unlinked once both workers attached
    engine.send_weights()
    assert_received(pool, tensors)
    assert len(client.payloads) == 2
    for payload in client.payloads:
        assert json.loads(json.dumps(payload)) == payload  # plain JSON: nothing to unpickle
    engine.shutdown()


@pytest.fixture(scope="module")
def one_worker() -> Iterator[WorkerPool]:
    """One worker holding `MODEL`, shared: each test connects its own trainer and shuts it
    down, and a refused handshake or update leaves the worker as good as new."""
    with WorkerPool("ipc", 1, model_factory=MODEL) as p:
        yield p


@pytest.fixture(scope="module")
def foreign_segment() -> Iterator[str]:
    """A wt segment that another process (not the trainer) owns."""
    code = (
        "import sys; from wt_kits.colocated import SharedSegment; "
        "s = SharedSegment.create(1 << 20); print(s.name, flush=True); sys.stdin.read(); "
        "s.close()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    readable, _, _ = select.select([proc.stdout], [], [], 60)
    assert readable, "the segment's owner did not start within 60s"
    name = proc.stdout.readline().strip()
    yield name
    proc.stdin.close()
    proc.wait(30)


def _first_segment(value: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda p: {**p, "segment_names": [value, *p["segment_names"][1:]]}


BAD_HANDSHAKES: dict[str, tuple[Callable[..., dict[str, Any]], str]] = {
    "not-a-wt-name": (_first_segment("../../etc/passwd"), r"segment_names\[0\].*not a wt"),
    "missing-segment": (
        lambda p: _first_segment(f"wt-{os.getpid()}-{'0' * 32}")(p),
        r"segment_names\[0\].*does not exist",
    ),
    "past-the-end": (
        lambda p: {**p, "packed_buffer_size_bytes": p["packed_buffer_size_bytes"] * 2},
        r"segment_names\[0\].*fewer than",
    ),
    "segment-count": (
        lambda p: {**p, "segment_names": p["segment_names"][:1]},
        r"'segment_names' has 1 entries",
    ),
    "trainer-pid": (lambda p: {**p, "trainer_pid": 1}, r"'trainer_pid' is 1"),
    "plane": (lambda p: {**p, "plane": "nvlink"}, r"'plane' must be one of"),
    "control-path": (lambda p: {**p, "control_path": "relative/sock"}, r"'control_path'"),
    "buffer-count": (lambda p: {**p, "packed_num_buffers": 10**8}, r"'packed_num_buffers'"),
}


@pytest.mark.parametrize("case", [*BAD_HANDSHAKES, "foreign-segment"])
def test_a_bad_handshake_is_refused_naming_the_field_with_nothing_loaded(
    one_worker: WorkerPool, case: str, foreign_segment: str
) -> None:
    if case == "foreign-segment":
        owner = foreign_segment.split("-")[1]
        rewrite, match = _first_segment(foreign_segment), rf"belongs to process {owner}"
    else:
        rewrite, match = BAD_HANDSHAKES[case]
    tensors = mixed_tensors(0, big_numel=BIG)
    p = one_worker
    before = {n: digest(t) for n, t in p.each("state_dict")[0].items()}
    with pytest.raises(WeightSyncRPCError, match=match):
        connect(p, DictSource(tensors), Tampering(p.client(), init=rewrite))
    assert our_segments(os.getpid()) == []  # the refused trainer released its segments
    after = {n: digest(t) for n, t in p.each("state_dict")[0].items()}
    assert after == before
    target = mixed_tensors(5, big_numel=BIG)
    engine = connect(p, DictSource(target))  # the worker is as good as new
    engine.send_weights()
    assert {n: digest(t) for n, t in p.each("state_dict")[0].items()} == {
        n: digest(t) for n, t in target.items()
    }
    engine.shutdown()


BAD_UPDATES: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "dtype": (
        lambda u: {**u, "dtype_names": ["Tensor", *u["dtype_names"][1:]]},
        r"dtype_names\[0\]",
    ),
    "stale-round": (lambda u: {**u, "round_id": 0}, r"'round_id' is 0"),
    "oversized": (
        lambda u: {**u, "shapes": [[10**12], *u["shapes"][1:]]},
        r"shapes\[0\]",
    ),
    "lengths": (lambda u: {**u, "names": u["names"][:-1]}, r"'names' has"),
    # same sizes, another layout: only the trainer's layout digests tell
    "transposed-shape": (
        lambda u: _reshaped(u, "model.embed_tokens.weight", [16, 37]),
        r"field 'shapes' is not what the trainer declared.*nothing was loaded",
    ),
    "swapped-names": (
        lambda u: _renamed(u, "model.layers.0.", "model.layers.2."),
        r"field 'names' is not what the trainer declared.*nothing was loaded",
    ),
}


def _reshaped(update: dict[str, Any], name: str, shape: list[int]) -> dict[str, Any]:
    shapes = [list(s) for s in update["shapes"]]
    shapes[update["names"].index(name)] = shape
    return {**update, "shapes": shapes}


def _renamed(update: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    """The layers named by prefixes `a` and `b` (of one layout) trade names."""

    def swap(name: str) -> str:
        if name.startswith(a):
            return b + name[len(a) :]
        if name.startswith(b):
            return a + name[len(b) :]
        return name

    return {**update, "names": [swap(n) for n in update["names"]]}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_a_bad_update_is_refused_naming_the_field_and_the_previous_weights_stay(
    one_worker: WorkerPool,
    case: str,
) -> None:
    rewrite, match = BAD_UPDATES[case]
    first = mixed_tensors(1, big_numel=BIG)
    p = one_worker
    client = Tampering(p.client())
    engine = connect(p, DictSource(first), client, packed_buffer_size_bytes=4096)
    engine.send_weights()
    want = {n: digest(t) for n, t in first.items()}
    client.update = rewrite
    engine.source = DictSource(mixed_tensors(2, big_numel=BIG))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncRPCError, match=match):
        engine.send_weights()
    assert time.monotonic() - t0 < 10
    assert {n: digest(t) for n, t in p.each("state_dict")[0].items()} == want
    client.update = None
    target = mixed_tensors(3, big_numel=BIG)
    engine.source = DictSource(target)
    engine.send_weights()  # the link carries the next round
    assert {n: digest(t) for n, t in p.each("state_dict")[0].items()} == {
        n: digest(t) for n, t in target.items()
    }
    assert len(client.handshakes) == 1  # on the same link: no re-attachment
    engine.shutdown()


def test_num_workers_must_match_the_workers_that_attach(pool: WorkerPool) -> None:
    with pytest.raises(ValueError, match=r"'num_workers' is 1, but 2 workers attached"):
        connect(pool, DictSource(mixed_tensors(0)), num_workers=1)
    assert our_segments(os.getpid()) == []


def test_a_hundred_syncs_leave_dev_shm_and_descriptors_as_they_were(pool: WorkerPool) -> None:
    tensors = mixed_tensors(8)
    pool.each("set_names", list(tensors))
    # this test's processes only: another xdist worker's ipc tests make segments meanwhile
    pids = [os.getpid(), *(p.pid for p in pool.processes)]

    def ours() -> list[str]:
        return sorted(name for pid in pids for name in our_segments(pid))

    shm_before = ours()
    engine = connect(pool, DictSource(tensors), packed_buffer_size_bytes=4096)
    engine.send_weights()
    gc.collect()  # what earlier tests left for the collector is not this engine's
    fds_after_first = len(os.listdir("/proc/self/fd"))
    for _ in range(99):
        engine.send_weights()
    assert_received(pool, tensors)
    gc.collect()
    # a leak of one per sync would be 99; other tests' threads in this process may hold
    # a few for a moment
    assert len(os.listdir("/proc/self/fd")) - fds_after_first < 10
    assert ours() == shm_before
    engine.shutdown()
    assert ours() == shm_before


# --- a 2-rank trainer: every rank materializes, only rank 0 writes the staging


def _trainer_rank(rank: int, group_port: int, client: Any, out: Any) -> None:
    from weight_transfer import ModuleSource

    torch.set_num_threads(1)
    try:
        model, full = dtensor_model(rank, group_port)
        info = IPCTrainerInitInfo(rank=rank, num_workers=WORKERS, timeout_s=30)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=client if rank == 0 else ForbiddenClient(), source=ModuleSource(model)
        )
        engine.send_weights()
        engine.send_weights()
        out.put((rank, "ok", {n: digest(t) for n, t in full.items()}, engine.staging is None))
        engine.shutdown()
        torch.distributed.destroy_process_group()
    except BaseException as e:
        out.put((rank, "err", f"{type(e).__name__}: {e}", None))


def test_two_rank_trainer_with_dtensor_source_two_workers() -> None:
    ctx = mp.get_context("spawn")
    with WorkerPool("ipc", WORKERS) as p:
        p.each("set_names", ["0.weight", "0.bias", "1.weight", "1.bias"])
        out = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_trainer_rank, args=(r, port, p.client(), out)) for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            results = {}
            for _ in range(2):
                rank, status, payload, no_staging = out.get(timeout=120)
                results[rank] = (status, payload, no_staging)
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        assert results[0][0] == "ok", results[0]
        assert results[1][0] == "ok", results[1]
        assert results[0][2] is False and results[1][2] is True  # only rank 0 exports
        for got in p.each("digests"):
            assert got == results[0][1]
        for proc in procs:
            assert our_segments(proc.pid) == []


# --- processes that die mid-round


def _doomed_trainer(client: Any, stall_at: int, stalled: Any, seed: int) -> None:
    tensors = mixed_tensors(seed, big_numel=BIG)
    info = IPCTrainerInitInfo(
        rank=0, timeout_s=60.0, packed_buffer_size_bytes=1024, packed_min_bucket_bytes=0
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=DictSource(tensors)
    )
    engine.send_weights()  # round 1 completes
    engine.source = StallingSource(tensors, stall_at, stalled)
    engine.send_weights()


@pytest.mark.parametrize("stall_at", [1, 9])
def test_a_killed_trainer_fails_the_worker_at_once_keeps_its_weights_and_leaks_nothing(
    stall_at: int,
) -> None:
    ctx = mp.get_context("spawn")
    with WorkerPool("ipc", 1, model_factory=MODEL) as p:
        stalled = ctx.Event()
        trainer = ctx.Process(target=_doomed_trainer, args=(p.client(), stall_at, stalled, 7))
        trainer.start()
        try:
            assert stalled.wait(120), "the trainer did not reach the stall"
            time.sleep(0.5)  # the worker now waits for the next bucket
        finally:
            trainer.kill()
            trainer.join(10)
        t0 = time.monotonic()
        client = p.client(timeout_s=60.0)
        with pytest.raises(WeightSyncRPCError, match=r"no transfer group \(it was torn down"):
            client.start_weight_update()  # answered once the worker's failed round has ended
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, f"the worker noticed the dead trainer after {elapsed:.1f}s"
        assert our_segments(trainer.pid) == []
        worker_pid = p.processes[0].pid
        with open(f"/proc/{worker_pid}/maps") as f:  # the worker unmapped the dead one's staging
            assert f"wt-{trainer.pid}-" not in f.read()
        round_one = {n: digest(t) for n, t in mixed_tensors(7, big_numel=BIG).items()}
        assert {n: digest(t) for n, t in p.each("state_dict")[0].items()} == round_one

        target = mixed_tensors(8, big_numel=BIG)
        fresh = connect(p, DictSource(target))  # the dead holder is replaced freely
        fresh.send_weights()
        assert {n: digest(t) for n, t in p.each("state_dict")[0].items()} == {
            n: digest(t) for n, t in target.items()
        }
        fresh.shutdown()


def test_a_killed_worker_fails_the_trainer_at_once_and_leaks_nothing() -> None:
    tensors = mixed_tensors(9, layers=8)
    with WorkerPool("ipc", 2, names=list(tensors), load_delay_s=0.3) as p:
        pids = [proc.pid for proc in p.processes]
        engine = connect(
            p, DictSource(tensors), p.client(timeout_s=60.0), timeout_s=60.0,
            packed_buffer_size_bytes=1024, packed_min_bucket_bytes=0,
        )  # fmt: skip
        killer = threading.Timer(1.0, p.kill, args=(1,))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            engine.send_weights()
        elapsed = time.monotonic() - t0
        killer.join()
        assert elapsed < 10, f"the trainer noticed the dead worker after {elapsed:.1f}s"
        message = str(err.value).lower()
        assert any(w in message for w in ("worker 1", "closed", "gone")), message
        with pytest.raises(ConnectionError):  # re-attaching reaches no worker 1
            engine.send_weights()
        engine.shutdown()
        for pid in [os.getpid(), *pids]:
            assert our_segments(pid) == []


def test_segments_refuse_what_they_cannot_serve() -> None:
    with pytest.raises(ValueError, match="positive size"):
        SharedSegment.create(0)
    segment = SharedSegment.create(4096)
    try:
        with pytest.raises(ValueError, match="belongs to process"):
            SharedSegment.attach(segment.name, 4096, owner_pid=os.getpid() + 1, owner_uid=0)
        with pytest.raises(ValueError, match="fewer than"):
            SharedSegment.attach(segment.name, 8192, owner_pid=os.getpid(), owner_uid=os.getuid())
        os.chmod(f"/dev/shm/{segment.name}", 0o644)
        with pytest.raises(ValueError, match="not a private segment"):
            SharedSegment.attach(segment.name, 4096, owner_pid=os.getpid(), owner_uid=os.getuid())
        os.chmod(f"/dev/shm/{segment.name}", 0o600)
        reader = SharedSegment.attach(
            segment.name, 4096, owner_pid=os.getpid(), owner_uid=os.getuid()
        )
        segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert reader.tensor[:4].tolist() == [1, 2, 3, 4]  # one memory, two mappings
        segment.unlink()
        assert our_segments(os.getpid()) == []
        assert reader.tensor[:4].tolist() == [1, 2, 3, 4]  # mappings outlive the name
        view = reader.tensor[:4]
        reader.close()
        segment.close()
        assert view.tolist() == [1, 2, 3, 4]  # close never unmaps under a live view
        assert _mapped(segment.name)
        del view
        assert not _mapped(segment.name)  # the mapping went with its last view
    finally:
        segment.close()


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()
