"""Worker (consumer) side of `sharded_rdt`: pull only the slices this worker keeps.

`init_transfer_engine`: refuse expert-parallel load balancing (it moves
experts at run time), compute the consumer id, find every producer and
check the handshake against what each describes (its rank, its metadata
field by field, its held names, `verify`: a disagreement is refused naming
the field, before anything is planned or reserved), run
the model's loading code once as a dry run over recording tensors (core's
`record_slices` through the loader's `dry_run`: an op outside the allowlist
fails here, naming the weight and the op), cut the result into a static plan
of pulls (`build_plan`), reserve this consumer's serve slots at each
producer it pulls from, and allocate the receive ring (`num_rdt_buffers`
slots of the largest pull).

`receive_weights` (one `update_weights` per sync) replays the plan: free the
groups it needs nothing from, then issue pulls in plan order, at most K in
flight; when the oldest lands, hand it to the scatter thread and free every
group whose last pull it was, in one call to each owner of those groups
(every owner of a group counts its free). A
receive slot is refilled only after the scatter of its previous chunk has
finished. Scattering writes each slice where the dry run saw it land
(`SliceLoader.write`), materializing a module before its first slice and
processing it after its last, while the next pulls land. It returns when
every pull has landed and every scatter has run, so a failure fails the
update, never the finish; `drain_pending` (run by `finish_weight_update`)
waits for the free acknowledgements. A heartbeat to every producer runs for the whole
sync, so a producer tells a silent consumer from a slow one.

With `verify`, the scatter thread first checks each landed blob against the
digest rows in its tail (`ConsumerPlan.digests`); a mismatch fails the sync
naming the parameter, the pull and the producer, and nothing of that pull or
any later one is written.

Each update is checked before anything is pulled: its `trainer_id` must be
the handshake's, its `sync_id` newer than the last sync this engine
finished (recorded at finish, so a refused or failed update never blocks the
next), its `live_consumers` within the handshake's consumers. A consumer that
the update leaves out tells the producers (`skip`), which fail the sync at
once if the trainer's live set has it.

Every wait is bounded: a pull by `stall_timeout_s` plus a grace, a scatter
by `timeout_s`. Any failure fails the round (core rolls the model back) and
tells the producers, so the trainer's ranks stop at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from typing import Any

import torch

from weight_transfer.backend import (
    PARAM_LIST_FIELDS,
    ParamMeta,
    WeightTransferEngine,
    param_list_digests,
)
from wt_kits.channel import GroupChannel
from wt_kits.slices import SliceLoader, SliceRecord, describe_chain, record_slices
from wt_kits.stream import BucketDigests, DigestMismatch, bucket_landed
from wt_sharded_rdt.links import producer_client
from wt_sharded_rdt.protocol import (
    Chunk,
    ConsumerPlan,
    Router,
    ShardedRDTUpdateInfo,
    ShardedRDTWorkerInitInfo,
    build_plan,
    chunk_expectation,
    digests_view,
    owner_table,
    pull_span,
)
from wt_sharded_rdt.transport import Pending, ProducerClient

__all__ = ["ShardedRDTWorkerEngine", "bake"]

logger = logging.getLogger("wt_sharded_rdt")

_GRACE_S = 30.0  # beyond the producer's own stall watchdog


class _Producers:
    """The consumer's producer handles, as the `Link` a `GroupChannel` holds."""

    def __init__(self, clients: list[ProducerClient]) -> None:
        self.clients = clients

    def abort(self) -> None:
        self.clients = []

    def close(self) -> None:
        self.clients = []

    def trainer_alive(self) -> bool:
        return any(client.alive() for client in self.clients)


def bake(loader: Any, groups: list[list[ParamMeta]]) -> tuple[SliceRecord, dict[str, list[str]]]:
    """Record the model's slices (a dry run); also each module's parameters the
    slices do not cover entirely (they start at zero when materialized)."""
    if not isinstance(loader, SliceLoader):
        raise TypeError(
            f"{type(loader).__name__} cannot take slices (sharded_rdt needs a SliceLoader: the "
            "built-in loaders are)"
        )
    with loader.dry_run() as (load, targets):
        record = record_slices(groups, load, targets)
        modules = {s.module for scatters in record.scatters.values() for s in scatters}
        zero: dict[str, list[str]] = {m: [] for m in modules}
        for module, param, tensor in targets.values():
            if module in zero and record.covered.get((module, param), 0) < tensor.numel():
                zero[module].append(param)
    return record, zero


class ShardedRDTWorkerEngine(WeightTransferEngine[ShardedRDTWorkerInitInfo, ShardedRDTUpdateInfo]):
    init_info_cls = ShardedRDTWorkerInitInfo
    update_info_cls = ShardedRDTUpdateInfo
    supports_draft_weight_update = False
    supports_adapter_update = False
    defers_processing = True

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device | str, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: GroupChannel[_Producers] = GroupChannel(
            "sharded_rdt", remedy="the trainer must run trainer_init again"
        )
        self.info: ShardedRDTWorkerInitInfo | None = None
        self.plan: ConsumerPlan | None = None
        self.group_of: dict[str, int] = {}  # gather group of each name
        self.zero: dict[str, list[str]] = {}
        self.consumer_id = 0
        self.slots: list[torch.Tensor] = []
        self.digests: BucketDigests | None = None  # the checker of verified blobs
        self.last_sync = 0  # the last sync this engine finished
        self._round_sync: int | None = None  # the sync the open round took
        self._failed: BaseException | None = None  # this sync's first scatter failure
        self.pulled_bytes = 0  # what the last sync moved to this worker
        self._scatter = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="wt-rdt-scatter"
        )
        self._scatters: list[concurrent.futures.Future[None]] = []
        self._frees: list[tuple[str, Pending]] = []
        self._beat: threading.Event | None = None

    # -- init ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: ShardedRDTWorkerInitInfo) -> None:
        """Find the producers, record the slices, plan, reserve (module docstring)."""
        self.channel.drop("the last init_weight_transfer_engine failed")
        if getattr(self.parallel_config, "enable_eplb", False):
            raise RuntimeError(
                "sharded_rdt: expert-parallel load balancing (enable_eplb) moves experts "
                "between workers at run time, so the slices recorded at init would land in "
                "the wrong experts"
            )
        index = self.position.global_index
        if index >= init_info.workers_per_replica:
            raise ValueError(
                f"init_info: field 'workers_per_replica' is {init_info.workers_per_replica}, but "
                f"this is worker {index} of its replica"
            )
        consumer_id = init_info.replica_rank * init_info.workers_per_replica + index
        clients = [
            producer_client(init_info.transport, n, init_info.namespace, init_info.ray_address)
            for n in init_info.producer_names
        ]
        check_producers(init_info, [client.describe() for client in clients])
        metas = {m.name: m for m in init_info.metas}
        groups = init_info.groups()
        self.group_of = {n: gi for gi, names in enumerate(groups) for n in names}
        record, zero = bake(self.new_loader(), [[metas[n] for n in names] for names in groups])
        router = Router(
            init_info.owner_sets, init_info.name_owner_class, init_info.names, init_info.metas
        )
        plan = build_plan(
            record,
            groups,
            router,
            consumer_id,
            init_info.chunk_bytes,
            init_info.verify,
            pull_span(init_info.gather_lookahead),
        )
        for owner, nbytes in plan.bytes_from().items():
            clients[owner].reserve(consumer_id, nbytes)
        self.slots = [
            torch.empty(max(plan.max_chunk_bytes, 1), dtype=torch.uint8, device=self.device)
            for _ in range(init_info.num_rdt_buffers)
        ]
        self.digests = plan.digests() if init_info.verify else None
        self.info, self.plan, self.zero = init_info, plan, zero
        self.consumer_id, self.last_sync = consumer_id, 0
        self.channel.connect(_Producers(clients), holder=init_info.trainer_id)
        logger.info(
            "sharded_rdt consumer %d: %d pulls, %d bytes per sync, from producers %s",
            consumer_id, len(plan.chunks), plan.total_bytes, sorted(plan.bytes_from()),
        )  # fmt: skip

    # -- one sync -----------------------------------------------------------------
    def start_weight_update(self) -> None:
        """A new sync (core has refused it if there are no producers to pull from,
        `require_connection`: the trainer then sends the handshake again)."""
        self._round_sync = None

    def receive_weights(self, update_info: ShardedRDTUpdateInfo) -> None:
        info, plan = self.info, self.plan
        if info is None or plan is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        producers = self.channel.require().clients
        try:
            self._check_update(update_info, info)
        except ValueError as error:  # the sync cannot complete here: end it everywhere now
            self._tell_producers(
                producers,
                f"consumer {self.consumer_id} refused its update: {error}",
                max(update_info.sync_id, self.last_sync + 1),  # the sync it ends
            )
            raise
        sync_id = self._round_sync = update_info.sync_id
        live = update_info.live_consumers
        if live and self.consumer_id not in live:
            logger.warning(
                "consumer %d is not live in sync %d: keeping its weights", self.consumer_id, sync_id
            )
            for producer in producers:
                producer.skip(sync_id, self.consumer_id)
            return
        self._scatters, self._frees, self._failed = [], [], None
        self._start_heartbeat(producers, sync_id, info.peer_timeout_s / 4)
        try:
            self._pull_all(producers, plan, sync_id, info)
        except BaseException as error:
            self._tell_producers(
                producers, f"consumer {self.consumer_id} failed sync {sync_id}: {error}", sync_id
            )
            raise

    def _check_update(self, update: ShardedRDTUpdateInfo, info: ShardedRDTWorkerInitInfo) -> None:
        """Refuse, naming the field, an update that is not this engine's next sync:
        `ValueError`, or `ChannelDownError` for a trainer that no longer holds it."""
        if update.trainer_id != self.channel.holder:
            raise ValueError(
                f"update_info: field 'trainer_id' is {update.trainer_id!r}, but this engine "
                f"serves trainer {self.channel.holder!r}"
            )
        if update.sync_id <= self.last_sync:
            raise ValueError(
                f"update_info: field 'sync_id' is {update.sync_id}, but sync {self.last_sync} "
                "already ran here (a stale or replayed update)"
            )
        if self._round_sync is not None:
            raise ValueError(
                f"update_info: this round already took sync {self._round_sync} (field "
                f"'sync_id' is {update.sync_id}); a round carries one update"
            )
        beyond = [c for c in update.live_consumers if c >= info.num_consumers]
        if beyond:
            raise ValueError(
                f"update_info: field 'live_consumers' names consumer {beyond[0]}, but the "
                f"handshake has {info.num_consumers} consumers"
            )

    def _pull_all(
        self,
        producers: list[ProducerClient],
        plan: ConsumerPlan,
        sync_id: int,
        info: ShardedRDTWorkerInitInfo,
    ) -> None:
        if plan.pre_free:
            self._free(producers, plan, sync_id, plan.pre_free)
        depth = len(self.slots)
        slot_user: list[concurrent.futures.Future[None] | None] = [None] * depth
        in_flight: deque[tuple[Chunk, Pending]] = deque()
        self.pulled_bytes = 0
        for chunk in plan.chunks:
            if self._failed is not None:
                raise self._failed  # nothing more is pulled once a scatter failed
            if len(in_flight) == depth:
                self._land(*in_flight.popleft(), producers, plan, sync_id, slot_user)
            slot = chunk.index % depth
            previous = slot_user[slot]
            if previous is not None:
                previous.result(info.timeout_s)  # its scatter read this slot
            into = self.slots[slot][: chunk.nbytes]
            pending = producers[chunk.owner].pull(
                sync_id, self.consumer_id, chunk.seq, chunk.keys, chunk_expectation(chunk), into
            )
            in_flight.append((chunk, pending))
        while in_flight:
            self._land(*in_flight.popleft(), producers, plan, sync_id, slot_user)
        self._wait_scatters(info.timeout_s)

    def _wait_scatters(self, timeout_s: float) -> None:
        """Every scatter of this sync done; the first failure raises.

        A failed scatter fails `update_weights`, never `finish_weight_update`:
        the workers of a replica finish one by one, so a failure there would
        leave the others committed.
        """
        for future in self._scatters:
            try:
                future.result(timeout_s)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"a scatter did not finish within {timeout_s:g}s") from None

    def _land(
        self,
        chunk: Chunk,
        pending: Pending,
        producers: list[ProducerClient],
        plan: ConsumerPlan,
        sync_id: int,
        slot_user: list[concurrent.futures.Future[None] | None],
    ) -> None:
        info = self.info
        assert info is not None
        producer = producers[chunk.owner]
        try:
            pending.result(info.stall_timeout_s + _GRACE_S)
        except Exception as error:
            raise RuntimeError(
                f"consumer {self.consumer_id}: pull {chunk.index} ({chunk.groups_text}, "
                f"{chunk.nbytes} bytes) from {producer.name} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        self.pulled_bytes += chunk.nbytes
        slot = chunk.index % len(self.slots)
        bucket_landed(chunk.index, self.slots[slot][: chunk.nbytes])
        future = self._scatter.submit(self._apply, chunk, self.slots[slot], producer.name)
        slot_user[slot] = future
        self._scatters.append(future)
        if chunk.frees:
            self._free(producers, plan, sync_id, chunk.frees)

    def _apply(self, chunk: Chunk, buffer: torch.Tensor, producer: str) -> None:
        """Check (verify) and scatter one landed pull; after a failure, write nothing."""
        if self._failed is not None:
            return
        try:
            if self.digests is not None:
                self._verify(chunk, buffer, producer)
            self._scatter_chunk(chunk, buffer)
        except DigestMismatch as error:
            self._failed = error
            raise
        except Exception as error:
            self._failed = RuntimeError(
                f"consumer {self.consumer_id}: scattering pull {chunk.index} "
                f"({chunk.groups_text}) failed: {type(error).__name__}: {error}"
            )
            raise self._failed from error

    def _verify(self, chunk: Chunk, buffer: torch.Tensor, producer: str) -> None:
        """Raise `DigestMismatch` naming the first slice of `chunk` whose bytes in
        `buffer` differ from the digests the producer wrote after them."""
        assert self.digests is not None
        expected = digests_view(buffer, chunk.layout)
        mine = self.digests.of(chunk.index, buffer)
        if torch.equal(mine, expected):
            return
        j = int((mine != expected).any(dim=1).nonzero()[0, 0])
        name, chain = chunk.keys[j]
        raise DigestMismatch(
            f"verify: consumer {self.consumer_id}: pull {chunk.index} "
            f"(group {self.group_of.get(name, chunk.group)}) "
            f"from {producer}: the slice of {name!r} ({describe_chain(chain)}) arrived "
            f"different from what the producer sent (digest {mine[j].tolist()} != "
            f"{expected[j].tolist()}); nothing of this pull was loaded",
            bucket=chunk.index,
            param=name,
        )

    def _scatter_chunk(self, chunk: Chunk, buffer: torch.Tensor) -> None:
        loader = self.loader
        assert isinstance(loader, SliceLoader)
        for module in chunk.begins:
            loader.begin_module(module, self.zero.get(module, ()))
        writes = []
        for scatters, offset in zip(chunk.scatters, chunk.offsets, strict=True):
            first = scatters[0]
            piece = buffer[offset : offset + first.nbytes].view(first.src_dtype)
            writes += [(scatter, piece) for scatter in scatters]
        loader.write(writes)
        for module in chunk.ends:
            loader.end_module(module)

    def _free(
        self, producers: list[ProducerClient], plan: ConsumerPlan, sync_id: int, groups: list[int]
    ) -> None:
        """Free `groups` (those a landed pull completes): one call to each of their owners."""
        by_owner: dict[int, list[int]] = {}
        for group in groups:
            for owner in plan.group_owners[group]:
                by_owner.setdefault(owner, []).append(group)
        for owner, owned in by_owner.items():
            producer = producers[owner]
            self._frees.append((producer.name, producer.free(sync_id, self.consumer_id, owned)))

    # -- completion -----------------------------------------------------------------
    def drain_pending(self) -> None:
        """Wait for every scatter, then every free acknowledgement; raise the first error."""
        info = self.info
        timeout_s = info.timeout_s if info is not None else 300.0
        frees, self._frees = self._frees, []
        try:
            self._wait_scatters(timeout_s)
            self._scatters = []
            for name, pending in frees:
                try:
                    pending.result(timeout_s)
                except Exception as error:
                    raise RuntimeError(
                        f"consumer {self.consumer_id}: {name} did not take a free signal: {error}"
                    ) from error
        except BaseException as error:
            logger.error("consumer %d: %s", self.consumer_id, error)
            raise
        finally:
            self._stop_heartbeat()

    def finish_weight_update(self) -> None:
        """Record the sync as run here (`drain_pending` and core's commit do the rest)."""
        if self._round_sync is not None:
            self.last_sync = self._round_sync
        self._round_sync = None

    def abort_weight_update(self) -> None:
        """Let scatters in flight end (bounded) before core restores the model."""
        self._round_sync = None
        self._stop_heartbeat()
        scatters, self._scatters = self._scatters, []
        self._frees = []
        concurrent.futures.wait(scatters, timeout=self.info.timeout_s if self.info else 30.0)

    # -- heartbeat ----------------------------------------------------------------------
    def _start_heartbeat(
        self, producers: list[ProducerClient], sync_id: int, every_s: float
    ) -> None:
        self._stop_heartbeat()
        stop = self._beat = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                for producer in producers:
                    with contextlib.suppress(Exception):
                        producer.heartbeat(sync_id, self.consumer_id)
                stop.wait(every_s)

        threading.Thread(target=beat, name="wt-rdt-heartbeat", daemon=True).start()

    def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.set()
            self._beat = None

    def _tell_producers(self, producers: list[ProducerClient], message: str, sync_id: int) -> None:
        """Fail sync `sync_id` at every producer (`Producer.consumer_failed`)."""
        for producer in producers:
            with contextlib.suppress(Exception):
                producer.consumer_failed(sync_id, self.consumer_id, message)

    def shutdown(self) -> None:
        self._stop_heartbeat()
        self.channel.close()
        self.slots = []
        self.plan = None
        self.digests = None


def check_producers(info: ShardedRDTWorkerInitInfo, described: list[dict[str, Any]]) -> None:
    """Refuse a handshake that disagrees with what its producers describe, naming the
    field: producer `i` must be rank `i`, hold the same metadata (digest per field of
    `PARAM_LIST_FIELDS`), hold the names the owner tables say, and agree on `verify`.
    Without this a consumer would plan pulls of sizes the producers do not serve."""
    mine = param_list_digests({name: getattr(info, name) for name in PARAM_LIST_FIELDS})
    for i, (name, producer) in enumerate(zip(info.producer_names, described, strict=True)):
        if producer["rank"] != i:
            raise ValueError(
                f"init_info: field 'producer_names[{i}]' is {name!r}, which is trainer rank "
                f"{producer['rank']}'s producer"
            )
        for field, want, got in zip(
            PARAM_LIST_FIELDS, producer["param_digests"], mine, strict=True
        ):
            if want != got:
                raise ValueError(
                    f"init_info: field {field!r} disagrees with the metadata producer {name!r} "
                    "serves (the handshake is not this trainer's)"
                )
        if producer.get("shard_layouts", {}) != info.shard_layouts:
            raise ValueError(
                f"init_info: field 'shard_layouts' disagrees with the shards producer {name!r} "
                "serves"
            )
        if bool(producer["verify"]) != info.verify:
            raise ValueError(
                f"init_info: field 'verify' is {info.verify}, producer {name!r} serves with "
                f"verify={bool(producer['verify'])}"
            )
    try:
        owner_sets, classes = owner_table(info.names, [p["held"] for p in described])
    except ValueError as error:
        raise ValueError(f"init_info: field 'producer_names': {error}") from None
    if owner_sets != [list(owners) for owners in info.owner_sets]:
        raise ValueError("init_info: field 'owner_sets' disagrees with what the producers hold")
    if classes != list(info.name_owner_class):
        raise ValueError(
            "init_info: field 'name_owner_class' disagrees with what the producers hold"
        )
