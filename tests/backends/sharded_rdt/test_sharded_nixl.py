"""`sharded_rdt` over Ray Direct Transport with NIXL, on a local Ray cluster (127.0.0.1).

Producers are Ray actors started by the trainer engines in this process;
consumers are Ray actors, each one inference worker pulling its slices over
NIXL (UCX on loopback). Every check compares a consumer's parameters bit for
bit with a fresh shard loaded the ordinary way.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.backends.sharded_rdt.ray_parts import ActorsClient, Consumer  # loopback env first

pytest.importorskip("nixl")
ray = pytest.importorskip("ray")

from tests.backends.sharded_rdt.models import checkpoint, reference  # noqa: E402
from tests.backends.sharded_rdt.test_sharded_loopback import HeldSource  # noqa: E402
from weight_transfer import WeightSyncRPCError  # noqa: E402
from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

_prefixes = itertools.count()


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The session's loopback cluster (`tests/conftest.py`)."""
    return ray_cluster


def consumers(
    cluster: Any, tp: int, replicas: int = 1, ranks: list[int] | None = None
) -> list[Any]:
    actor_cls = cluster.remote(num_cpus=0)(Consumer)
    which = ranks if ranks is not None else list(range(tp))
    actors = [actor_cls.remote(r, tp) for _ in range(replicas) for r in which]
    cluster.get([a.pid.remote() for a in actors], timeout=120)
    return actors


def info(rank: int, num_consumers: int, prefix: str, **kw: Any) -> ShardedRDTTrainerInitInfo:
    defaults: dict[str, Any] = dict(
        num_consumers=num_consumers,
        transport="nixl",
        producer_prefix=prefix,
        timeout_s=60.0,
        stall_timeout_s=20.0,
        peer_timeout_s=10.0,
    )
    defaults.update(kw)
    return ShardedRDTTrainerInitInfo(rank=rank, **defaults)


def assert_serving(
    cluster: Any, actors: list[Any], tp: int, seed: int, *, synced: bool = True
) -> None:
    """Each consumer holds its shard of `seed`; after a sync (`synced`) it pulled its share."""
    for actor in actors:
        cluster.get(actor.end_round.remote(), timeout=60)
    for i, actor in enumerate(actors):
        params, pulled, share = cluster.get(actor.state.remote(), timeout=60)
        want = reference(seed, i % tp, tp)
        for name, got in params.items():
            assert torch.equal(got, want[name]), f"consumer {i}: {name} differs from seed {seed}"
        if synced:
            assert abs(pulled - share) <= 0.05 * share, (
                f"consumer {i} pulled {pulled}, share {share}"
            )


class GatedSource(HeldSource):
    """Stops before yielding `at` until `go` is set, after setting `reached`."""

    def __init__(self, tensors: dict[str, torch.Tensor], at: str) -> None:
        super().__init__(tensors)
        self.at = at
        self.reached, self.go = threading.Event(), threading.Event()
        self.armed = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, tensor in super().__iter__():
            if self.armed and name == self.at:
                self.reached.set()
                assert self.go.wait(120)
            yield name, tensor


def _sync_in_background(trainer: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            trainer.send_weights()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_producer_killed_mid_sync(cluster: Any) -> None:
    actors = consumers(cluster, 2)
    source = GatedSource(checkpoint(1), at="layers.1.q.weight")
    prefix = f"wt-nixl-{next(_prefixes)}"
    trainer = ShardedRDTTrainerEngine.trainer_init(
        info(0, 2, prefix), client=ActorsClient(actors), source=source
    )
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        source.tensors, source.armed = checkpoint(3), True
        thread, errors = _sync_in_background(trainer)
        assert source.reached.wait(60)
        started = time.monotonic()
        ray.kill(ray.get_actor(f"{prefix}-rk0"))
        source.go.set()
        thread.join(60)
        assert not thread.is_alive() and errors
        assert time.monotonic() - started < 30
        assert_serving(cluster, actors, 2, 2, synced=False)
        # the trainer restarts its producer (a new engine); the workers take it over
        trainer.shutdown()
        source.armed = False
        trainer = ShardedRDTTrainerEngine.trainer_init(
            info(0, 2, prefix), client=ActorsClient(actors), source=source
        )
        trainer.send_weights()
        assert_serving(cluster, actors, 2, 3)
    finally:
        trainer.shutdown()
        for a in actors:
            ray.kill(a)


def test_consumer_killed_mid_sync(cluster: Any) -> None:
    actors = consumers(cluster, 2)
    source = GatedSource(checkpoint(1), at="layers.1.q.weight")
    prefix = f"wt-nixl-{next(_prefixes)}"
    client = ActorsClient(actors)
    trainer = ShardedRDTTrainerEngine.trainer_init(info(0, 2, prefix), client=client, source=source)
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        source.tensors, source.armed = checkpoint(3), True
        thread, errors = _sync_in_background(trainer)
        assert source.reached.wait(60)
        started = time.monotonic()
        ray.kill(actors[1])
        source.go.set()
        thread.join(60)
        assert not thread.is_alive() and errors
        assert isinstance(errors[0], WeightSyncRPCError)
        assert "worker 1: ActorDiedError" in str(errors[0]) or "consumer 1 went silent" in str(
            errors[0]
        )
        assert time.monotonic() - started < 30
        # the worker restarts and rejoins from the payload the trainer keeps
        (actors[1],) = consumers(cluster, 2, ranks=[1])
        client.actors = actors
        cluster.get(
            actors[1].call.remote("init_weight_transfer_engine", trainer.get_worker_init_payload()),
            timeout=60,
        )
        source.armed = False
        trainer.send_weights()
        assert_serving(cluster, actors, 2, 3)
    finally:
        trainer.shutdown()
        for a in actors:
            ray.kill(a)


class RaisingSource(HeldSource):
    def __init__(self, tensors: dict[str, torch.Tensor], at: str) -> None:
        super().__init__(tensors)
        self.at = at

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name, tensor in super().__iter__():
            if name == self.at:
                raise RuntimeError(f"lost the shard holding {name}")
            yield name, tensor


def test_trainer_failure_mid_sync_over_nixl(cluster: Any) -> None:
    """The consumers' updates fail at once (no waiting out a timeout) and roll back."""
    actors = consumers(cluster, 2)
    source = HeldSource(checkpoint(1))
    prefix = f"wt-nixl-{next(_prefixes)}"
    trainer = ShardedRDTTrainerEngine.trainer_init(
        info(0, 2, prefix), client=ActorsClient(actors), source=source
    )
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        trainer.source = RaisingSource(checkpoint(3), "layers.1.o.weight")
        with pytest.raises(RuntimeError, match="lost the shard"):
            trainer.send_weights()
        started = time.monotonic()
        while any(cluster.get([a.round_open.remote() for a in actors], timeout=60)):
            assert time.monotonic() - started < 10, "the consumers' rounds stayed open"
            time.sleep(0.1)
        assert_serving(cluster, actors, 2, 2, synced=False)
        trainer.source = source
        source.tensors = checkpoint(3)
        trainer.send_weights()
        assert_serving(cluster, actors, 2, 3)
    finally:
        trainer.shutdown()
        for a in actors:
            ray.kill(a)


def test_verified_pulls_over_nixl_refuse_a_corrupted_byte(cluster: Any) -> None:
    """verify=True: a clean sync is bit-exact; a byte flipped in consumer 1's receive
    slot after NIXL landed it fails the sync naming the parameter, the pull and the
    producer, every consumer keeps its weights, and the next sync works."""
    actors = consumers(cluster, 2)
    source = HeldSource(checkpoint(1))
    prefix = f"wt-nixl-{next(_prefixes)}"
    trainer = ShardedRDTTrainerEngine.trainer_init(
        info(0, 2, prefix, verify=True), client=ActorsClient(actors), source=source
    )
    name = "layers.0.down.weight"
    try:
        source.tensors = checkpoint(2)
        trainer.send_weights()
        assert_serving(cluster, actors, 2, 2)
        pull = cluster.get(actors[1].corrupt.remote(name), timeout=60)
        source.tensors = checkpoint(3)
        with pytest.raises(
            WeightSyncRPCError,
            match=rf"verify: consumer 1: pull {pull} \(group 1\) from {prefix}-rk0: the slice of "
            rf"'{name}' \(narrow\(1, 24, 24\)\) arrived different",
        ):
            trainer.send_weights()
        assert_serving(cluster, actors, 2, 2, synced=False)
        cluster.get(actors[1].corrupt.remote(None), timeout=60)
        trainer.send_weights()
        assert_serving(cluster, actors, 2, 3)
    finally:
        trainer.shutdown()
        for a in actors:
            ray.kill(a)


def busiest_thread(pid: int, window_s: float = 2.0) -> tuple[str, float]:
    """The thread of process `pid` that used the most CPU over `window_s` (/proc), and
    its share of one core. A busy loop uses a core, or on a busy machine its share of
    the cores (over a third of one in the full suite); a thread that sleeps until an
    event or a timer uses almost none, however busy the machine."""

    def cpu_ticks() -> dict[tuple[int, str], int]:
        ticks = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            ticks[(int(tid), name)] = int(fields[11]) + int(fields[12])  # utime + stime
        return ticks

    before = cpu_ticks()
    started = time.monotonic()
    time.sleep(window_s)
    after = cpu_ticks()
    elapsed = time.monotonic() - started
    used = {key: after[key] - before[key] for key in before.keys() & after.keys()}
    (tid, name), ticks = max(used.items(), key=lambda item: item[1])
    return f"{name} ({tid})", ticks / os.sysconf("SC_CLK_TCK") / elapsed


def test_idle_producers_and_consumers_sleep_between_syncs(cluster: Any) -> None:
    """After a sync, no thread of the producer actor or of a consumer busy-loops
    (NIXL's progress thread polls, `wt_sharded_rdt.nixl_progress`); the next sync works."""
    (actor,) = consumers(cluster, 1)
    source = HeldSource(checkpoint(2))
    prefix = f"wt-nixl-{next(_prefixes)}"
    trainer = ShardedRDTTrainerEngine.trainer_init(
        info(0, 1, prefix), client=ActorsClient([actor]), source=source
    )
    try:
        trainer.send_weights()
        producer = cluster.get(cluster.get_actor(f"{prefix}-rk0").ping.remote(), timeout=60)
        consumer = cluster.get(actor.pid.remote(), timeout=60)
        for who, pid in (("producer", producer), ("consumer", consumer)):
            thread, share = busiest_thread(pid)
            assert share < 0.1, f"{who}: thread {thread} used {share:.0%} of a core, idle"
        source.tensors = checkpoint(3)
        trainer.send_weights()
        assert_serving(cluster, [actor], 1, 3)
    finally:
        trainer.shutdown()
        ray.kill(actor)


class _Niced:
    """A Ray actor whose threads are put below the driver's priority (niceness 15, as
    Ray starts workers by default), then raised by `match_priority`."""

    def lower_then_match(self, driver_pid: int) -> tuple[int, int, int, list[int]]:
        from wt_sharded_rdt.ray_actor import match_priority

        tids = [int(t) for t in os.listdir("/proc/self/task")]
        started = max(os.getpriority(os.PRIO_PROCESS, t) for t in tids)
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, 15)
        lowered = max(os.getpriority(os.PRIO_PROCESS, t) for t in tids)
        highest = match_priority(driver_pid)
        return started, lowered, highest, [os.getpriority(os.PRIO_PROCESS, t) for t in tids]


def test_actors_and_the_producer_run_at_the_trainers_priority(cluster: Any) -> None:
    """The test cluster's workers run at this process's niceness (Ray's default is 15),
    and a producer actor below the trainer's priority raises every thread of its own
    to it (under load, an actor at 15 answered a 20 ms call in 1.3 s)."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    actor = cluster.remote(num_cpus=0)(_Niced).remote()
    try:
        started, lowered, highest, threads = cluster.get(
            actor.lower_then_match.remote(os.getpid()), timeout=60
        )
    finally:
        cluster.kill(actor)
    assert started == mine
    assert lowered == 15
    assert highest == mine and set(threads) == {mine}, threads


def test_a_producer_that_may_not_raise_its_priority_reports_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the OS refuses (no `CAP_SYS_NICE`), the threads keep their niceness and
    `match_priority` returns it, which the trainer's `RayHost` logs as a warning."""
    from wt_sharded_rdt.ray_actor import match_priority

    lowered, release = threading.Event(), threading.Event()

    def niced() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, 15)  # this thread only (Linux)
        lowered.set()
        release.wait(30)

    thread = threading.Thread(target=niced)
    thread.start()
    try:
        assert lowered.wait(30)

        def refuse(*args: Any) -> None:
            raise PermissionError("raising a priority takes CAP_SYS_NICE")

        monkeypatch.setattr(os, "setpriority", refuse)
        assert match_priority(os.getpid()) == 15
        monkeypatch.undo()
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == 15
    finally:
        release.set()
        thread.join(30)
