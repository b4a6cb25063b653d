"""Trainer side of `sharded_rdt`: every rank publishes what it holds; consumers pull.

`trainer_init`, on every rank: check the source (`held_names()` must name
known parameters and not be empty, and the owners a parameter declares must
be ranks of this trainer), start this rank's producer (named
`<producer_prefix>-rk<rank>`, from the init info's explicit `rank`). The
sender (rank 0) then finds every rank's producer (bounded wait), checks that
all ranks describe the same metadata (digest) and that every name has a
holder, builds the handshake and runs the workers' init, which returns once
each consumer has recorded its slices and reserved its serve slots. Nothing
here is a collective: the producers carry each rank's description, so
`get_worker_init_payload()` rebuilds the handshake for a restarted engine.

`send_weights`, on every rank, once per sync: the sender opens a round on
the workers (`update_weights` in flight: they pull inside it) and every rank
runs the gather loop: it stages its groups (`WeightSource.iter_groups`, or
with `local_shards` its own pieces from `iter_local`, so nothing gathers)
span by span (`pull_span`: the windows of group indices a consumer's pull
holds) and publishes each span in one call to its producer, once at most one
other span is published and not yet freed by every live consumer. The loop
ends when all its groups are freed. Waits poll the producer, so the
sender sees a failed worker at once, and the producer's watchdog bounds
every rank. On failure the rank's producer fails its waiters (the sender
fails every rank's), so consumers stop pulling and roll back.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weight_transfer.backend import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    check_int_range,
    check_timeout,
    fleet_of,
    layerwise_groups,
    param_list_digests,
    param_list_payload,
    payload_of,
)
from wt_kits.slices import local_box
from wt_kits.stream import aligned_layout, first_non_finite
from wt_kits.waits import PEER_GRACE_S, in_background, wait_for
from wt_sharded_rdt.links import host_producer, producer_client, ray_location
from wt_sharded_rdt.producer import ProducerError
from wt_sharded_rdt.protocol import (
    DEFAULT_CHUNK_BYTES,
    MAX_CONSUMERS,
    MAX_LOOKAHEAD,
    MAX_PRODUCERS,
    TRANSPORTS,
    ShardedRDTWorkerInitInfo,
    auto_lookahead,
    metadata_digest,
    owner_table,
    pull_span,
)
from wt_sharded_rdt.shards import check_owner_ranks, encode_layout
from wt_sharded_rdt.transport import ProducerClient, ProducerHost, forwarded_env

__all__ = ["ShardedRDTTrainerInitInfo", "ShardedRDTTrainerEngine"]

logger = logging.getLogger("wt_sharded_rdt")

_POLL_S = 0.5
_RPC_GRACE_S = 60.0  # the workers' init records slices and reserves buffers


@dataclass
class ShardedRDTTrainerInitInfo(TrainerInitInfo):
    """How each trainer rank configures `sharded_rdt` (identical on all ranks but `rank`).

    `num_consumers`: inference workers across all replicas (each replica has
    `num_consumers // num_replicas`). `num_trainer_ranks`: how many ranks run
    producers (the sender waits for all of them). `transport`: `"nixl"` (Ray
    actors, RDT over NIXL) or `"loopback"` (trainer and consumers in one
    process). Producer names are `<producer_prefix>-rk<rank>` in Ray
    namespace `namespace`. `num_rdt_buffers`: receive and serve ring depth.
    `gather_lookahead`: groups published but not yet freed, beyond the one
    being gathered (`None`: as many as about 512 MiB of staging holds at the
    largest group's size, `auto_lookahead`); the groups go out in spans of
    `pull_span(gather_lookahead)` groups, one publish and one pull per
    producer a span, and a rank keeps at most two spans published: fewer,
    larger calls. `chunk_bytes`: the largest pull (a larger slice is a pull of
    its own). `stall_timeout_s`: a sync with no progress at a producer for this
    long fails; `peer_timeout_s`: a consumer silent this long while a
    group waits for it fails the sync, naming it. `actor_env`: environment
    for the producer actors, on top of this process's `UCX_*` / `NIXL_*`.
    `verify`: every pulled blob carries the digests of its slices, which the
    consumer checks before scattering it (a mismatch fails the sync naming
    the parameter; it costs about two passes over the bytes on each side).
    `local_shards`: each rank publishes its local piece of every parameter it
    owns (`iter_local`, laid out by `ParamMeta.placements`) and consumers pull
    the pieces their slices need from the ranks that hold them, so no rank
    ever gathers a full tensor (`wt_sharded_rdt.shards`); `None` (default):
    when the source implements `iter_local` and declares a sharded parameter
    (`ModuleSource` over FSDP2 / DTensor parameters does).
    """

    backend: ClassVar[str] = "sharded_rdt"
    num_consumers: int = field(kw_only=True)
    num_trainer_ranks: int = field(default=1, kw_only=True)
    num_replicas: int = field(default=1, kw_only=True)
    transport: str = field(default="nixl", kw_only=True)
    producer_prefix: str = field(default="wt-rdt", kw_only=True)
    namespace: str | None = field(default=None, kw_only=True)
    num_rdt_buffers: int = field(default=2, kw_only=True)
    gather_lookahead: int | None = field(default=None, kw_only=True)
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, kw_only=True)
    stall_timeout_s: float = field(default=300.0, kw_only=True)
    peer_timeout_s: float = field(default=30.0, kw_only=True)
    timeout_s: float = field(default=300.0, kw_only=True)
    actor_env: dict[str, str] = field(default_factory=dict, kw_only=True)
    replace_trainer: bool = field(default=False, kw_only=True)
    verify: bool = field(default=False, kw_only=True)
    local_shards: bool | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        what = type(self).__name__
        check_int_range(
            self.num_consumers, field="num_consumers", what=what, low=1, high=MAX_CONSUMERS
        )
        check_int_range(
            self.num_trainer_ranks, field="num_trainer_ranks", what=what, low=1, high=MAX_PRODUCERS
        )
        check_int_range(self.rank, field="rank", what=what, low=0, high=self.num_trainer_ranks - 1)
        check_int_range(
            self.num_replicas, field="num_replicas", what=what, low=1, high=self.num_consumers
        )
        if self.num_consumers % self.num_replicas:
            raise ValueError(
                f"{what}: field 'num_consumers' ({self.num_consumers}) must be a multiple of "
                f"'num_replicas' ({self.num_replicas})"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"{what}: field 'transport' must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if not self.producer_prefix or "/" in self.producer_prefix:
            raise ValueError(
                f"{what}: field 'producer_prefix' must be a non-empty name, "
                f"got {self.producer_prefix!r}"
            )
        check_int_range(self.num_rdt_buffers, field="num_rdt_buffers", what=what, low=1, high=16)
        if self.gather_lookahead is not None:
            check_int_range(
                self.gather_lookahead,
                field="gather_lookahead",
                what=what,
                low=0,
                high=MAX_LOOKAHEAD,
            )
        check_int_range(self.chunk_bytes, field="chunk_bytes", what=what, low=1 << 10, high=1 << 40)
        for name in ("stall_timeout_s", "peer_timeout_s", "timeout_s"):
            check_timeout(getattr(self, name), field=name, what=what)

    def producer_name(self, rank: int) -> str:
        return f"{self.producer_prefix}-rk{rank}"


class ShardedRDTTrainerEngine(TrainerWeightTransferEngine[ShardedRDTTrainerInitInfo]):
    init_info_cls = ShardedRDTTrainerInitInfo
    sends_adapters = False  # slices are planned against the model's loaders

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        info: ShardedRDTTrainerInitInfo,
    ) -> None:
        super().__init__(
            client=client,
            source=source,
            is_sender=info.is_sender,
            timeout_s=info.timeout_s,
            rank=info.rank,
        )
        self.info: ShardedRDTTrainerInitInfo = info
        source = self.source
        self.metas = source.metadata()
        for meta in self.metas:
            check_owner_ranks(meta, info.num_trainer_ranks)
        self.groups = layerwise_groups(m.name for m in self.metas)
        self.group_of = {n: gi for gi, names in enumerate(self.groups) for n in names}
        self.meta_of = {m.name: m for m in self.metas}
        self.held = _held_names(source.held_names(), self.meta_of)
        self.local = _sends_local_shards(info.local_shards, source, self.metas)
        self.layouts: dict[str, list[list[int]]] = {}
        self.shape_of = {m.name: tuple(m.shape) for m in self.metas}
        if self.local:
            self.held = frozenset(n for n in self.held if self.meta_of[n].owned_by(info.rank))
            self.layouts = {m.name: encode_layout(m) for m in self.metas if m.placements}
            for name in self.held:
                box = local_box(self.meta_of[name], info.rank)
                self.shape_of[name] = tuple(n for _, n in box)
        self.digest = metadata_digest(self.metas)
        self.owned = [
            gi for gi, names in enumerate(self.groups) if any(n in self.held for n in names)
        ]
        self.lookahead = (
            info.gather_lookahead
            if info.gather_lookahead is not None
            else auto_lookahead(
                [aligned_layout([self.meta_of[n].nbytes for n in g])[1] for g in self.groups]
            )  # from the metadata alone, so every rank derives the same
        )
        self.span = pull_span(self.lookahead)
        self.slots = 2 if self.lookahead else 1  # spans published and not yet freed
        self.sync_id = 0
        self.check_finite = True  # refuse NaN / infinity before they are published
        self.namespace, self.ray_address = info.namespace, None
        if info.transport == "nixl":
            self.namespace, self.ray_address = ray_location(info.namespace)
        self.host: ProducerHost | None = None
        self.peers: list[ProducerClient] = []
        self._tables: tuple[list[list[int]], list[int]] | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: ShardedRDTTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> ShardedRDTTrainerEngine:
        """Start this rank's producer; the sender also attaches the workers (module docstring)."""
        if source is None:
            raise ValueError(
                "sharded_rdt is a full-resync backend: trainer_init needs a WeightSource"
            )
        engine = cls(client=client, source=source, info=init_info)
        engine._start_producer()
        try:
            if engine.is_sender:
                engine._attach_workers()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    # -- init ------------------------------------------------------------------
    def _start_producer(self) -> None:
        info = self.info
        by_span: dict[int, list[int]] = {}
        for gi in self.owned:
            by_span.setdefault(gi // self.span, []).extend(
                self._nbytes(n) for n in self.groups[gi] if n in self.held
            )
        staging = max((aligned_layout(sizes)[1] for sizes in by_span.values()), default=0)
        self.host = host_producer(
            info.transport,
            info.producer_name(info.rank),
            self.namespace,
            {
                "rank": info.rank,
                "served_names": sorted(self.held),
                "digest": self.digest,
                "held": [m.name in self.held for m in self.metas],
                "num_buffers": info.num_rdt_buffers,
                "stall_timeout_s": info.stall_timeout_s,
                "peer_timeout_s": info.peer_timeout_s,
                "param_digests": param_list_digests(param_list_payload(self.metas)),
                "verify": info.verify,
                "shard_layouts": self.layouts,
            },
            staging_bytes=staging,
            staging_slots=self.slots,
            max_concurrency=info.num_consumers * info.num_rdt_buffers + 8,
            env=forwarded_env(info.actor_env),
        )

    def _find_producers(self) -> list[ProducerClient]:
        info = self.info
        deadline = time.monotonic() + info.timeout_s
        peers: list[ProducerClient] = []
        for rank in range(info.num_trainer_ranks):
            name = info.producer_name(rank)
            while True:
                try:
                    peers.append(producer_client(info.transport, name, self.namespace))
                    break
                except RuntimeError as error:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"trainer rank {rank}'s producer {name!r} did not appear within "
                            f"{info.timeout_s:g}s (has that rank run trainer_init?): {error}"
                        ) from None
                    time.sleep(_POLL_S)
        return peers

    def _owner_tables(self) -> tuple[list[list[int]], list[int]]:
        if self._tables is None:
            self.peers = self._find_producers()
            masks: list[list[bool]] = []
            for rank, peer in enumerate(self.peers):
                described = peer.describe()
                if described["digest"] != self.digest:
                    raise ValueError(
                        f"trainer rank {rank} describes different metadata (digest "
                        f"{described['digest']}) than rank {self.info.rank} ({self.digest}): "
                        "every rank's source must list the same names, dtypes and shapes in order"
                    )
                masks.append(list(described["held"]))
            self._tables = owner_table([m.name for m in self.metas], masks)
        return self._tables

    def get_worker_init_payload(self, replica_rank: int = 0) -> dict[str, Any]:
        """The handshake for replica `replica_rank`, rebuilt from what init kept."""
        if self.host is None:
            raise RuntimeError("get_worker_init_payload before trainer_init")
        info = self.info
        owner_sets, classes = self._owner_tables()
        return payload_of(
            ShardedRDTWorkerInitInfo(
                transport=info.transport,
                producer_names=[info.producer_name(r) for r in range(info.num_trainer_ranks)],
                namespace=self.namespace,
                ray_address=self.ray_address,
                **param_list_payload(self.metas),
                group_lens=[len(g) for g in self.groups],
                owner_sets=owner_sets,
                name_owner_class=classes,
                num_consumers=info.num_consumers,
                workers_per_replica=info.num_consumers // info.num_replicas,
                replica_rank=replica_rank,
                num_rdt_buffers=info.num_rdt_buffers,
                chunk_bytes=info.chunk_bytes,
                gather_lookahead=self.lookahead,
                stall_timeout_s=info.stall_timeout_s,
                peer_timeout_s=info.peer_timeout_s,
                timeout_s=info.timeout_s,
                trainer_id=self.trainer_id,
                replace=info.replace_trainer,
                verify=info.verify,
                shard_layouts=self.layouts,
            )
        )

    def _attach_workers(self) -> None:
        """Send every replica its own handshake (a fleet's `init_replicas`, core's keyed path)."""
        fleet = fleet_of(self.client)
        replicas = len(fleet.replicas) if fleet is not None else 1
        if replicas != self.info.num_replicas:
            raise ValueError(
                f"ShardedRDTTrainerInitInfo: field 'num_replicas' is {self.info.num_replicas}, "
                f"the client reaches {replicas} replicas"
            )
        payloads = [self.get_worker_init_payload(r) for r in range(replicas)]
        if fleet is not None:
            call = functools.partial(fleet.init_replicas, payloads)
        else:
            call = functools.partial(self.client.init_weight_transfer_engine, payloads[0])
        rpc = in_background(call, name="wt-rdt-init")
        wait_for(
            {"the workers' init_weight_transfer_engine": rpc}, self.info.timeout_s + _RPC_GRACE_S
        )

    def reconnect(self) -> None:
        """Send every replica its handshake again (a restarted one joins; the others
        re-plan against the same producers)."""
        self._attach_workers()

    # -- one sync ----------------------------------------------------------------
    def send_weights(
        self, weight_version: str | None = None, *, live_consumers: Collection[int] | None = None
    ) -> None:
        """One sync on this rank (every rank calls it, with the same `live_consumers`).

        `live_consumers` (default: all) are the consumer ids that take part; a
        degraded set keeps the others on their previous weights.
        """
        source = self.source
        assert source is not None
        metas = source.metadata()
        if metadata_digest(metas) != self.digest:
            raise ValueError(
                "the source's metadata changed since trainer_init; run trainer_init again"
            )
        self.sync_id += 1
        every = list(range(self.info.num_consumers))
        live = sorted(set(live_consumers)) if live_consumers is not None else every
        if not set(live) <= set(every) or not live:
            raise ValueError(
                f"live_consumers must be a non-empty subset of 0..{len(every) - 1}, got {live}"
            )
        if live != every:
            logger.warning(
                "sync %d runs with %d of %d consumers", self.sync_id, len(live), len(every)
            )
        sync_id = self.sync_id
        if not self.is_sender:
            self._gather(sync_id, live, None)
            return
        self._owner_tables()  # the peers, for failing every rank at once
        round_ = self.open_round(
            num_params=len(metas),
            total_bytes=sum(m.nbytes for m in metas),
            num_chunks=len(self.owned),
        )
        update = {
            "trainer_id": self.trainer_id,
            "sync_id": sync_id,
            "live_consumers": [] if live == every else live,
        }
        round_.update(update, lambda transfer: self._gather(sync_id, live, transfer))
        round_.finish(weight_version)

    def _gather(self, sync_id: int, live: list[int], transfer: Transfer | None) -> None:
        host = self.host
        source = self.source
        if host is None or source is None:
            raise RuntimeError("send_weights before trainer_init (or after shutdown)")
        host.begin_sync(sync_id, live)
        try:
            in_flight: dict[int, set[int]] = {}  # span -> its published groups not yet freed
            staged: dict[str, torch.Tensor] = {}  # the open span's tensors, as they will be served
            floating: list[torch.Tensor] = []  # the same bytes in runs, for the finite check
            open_span, open_groups = -1, set[int]()

            def publish() -> None:
                if not open_groups:
                    return
                if self.check_finite:  # the span at once: one host read
                    self._check_finite(staged, floating)
                host.publish()
                in_flight[open_span] = set(open_groups)
                if transfer is not None:
                    transfer.chunk_moved(sum(t.numel() * t.element_size() for t in staged.values()))

            groups = self._local_groups() if self.local else source.iter_groups()
            for names, tensors in groups:
                group = self._check_group(names)
                batch = self._held_batch(names, tensors)
                if not batch:
                    continue
                if group // self.span != open_span:
                    publish()
                    open_span, open_groups, staged, floating = group // self.span, set(), {}, []
                    while len(in_flight) >= self.slots:
                        self._drain(in_flight, transfer)
                served, runs = host.stage(group, batch)
                staged.update(zip(batch, served, strict=True))
                floating += runs
                open_groups.add(group)
            publish()
            while in_flight:
                self._drain(in_flight, transfer)
            host.end_sync(self.info.stall_timeout_s)
        except BaseException as error:
            reason = f"{type(error).__name__}: {error}"
            self._fail_sync(
                f"trainer rank {self.info.rank} failed sync {sync_id}: {reason}", sync_id
            )
            if transfer is not None:
                # The workers stop at the producers' error and roll back; give
                # their update a grace to end, so that a failed sync returns
                # with the workers serving their previous weights.
                reported = transfer.worker_error(within_s=PEER_GRACE_S)
                if reported is not None and isinstance(error, ProducerError):
                    raise reported from error  # a worker failed: its own error says why
            raise

    def _local_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor | None]]]:
        """`iter_local()` in gather groups, None for the names this rank does not own;
        `ValueError` names the parameter where it strays from metadata order."""
        assert self.source is not None
        pairs = iter(self.source.iter_local())
        rank = self.info.rank
        for names in self.groups:
            tensors: list[torch.Tensor | None] = []
            for name in names:
                if name not in self.held:
                    tensors.append(None)
                    continue
                pair = next(pairs, None)
                if pair is None or pair[0] != name:
                    got = "nothing more" if pair is None else repr(pair[0])
                    raise ValueError(
                        f"iter_local() on rank {rank} yielded {got} where {name!r} comes next "
                        "(the names this rank owns, in metadata order)"
                    )
                tensors.append(pair[1])
            yield names, tensors
        extra = next(pairs, None)
        if extra is not None:
            raise ValueError(
                f"iter_local() on rank {rank} yielded {extra[0]!r} after every name it owns"
            )

    def _nbytes(self, name: str) -> int:
        return math.prod(self.shape_of[name]) * self.meta_of[name].dtype.itemsize

    def _check_group(self, names: list[str]) -> int:
        group = self.group_of.get(names[0], -1) if names else -1
        if group < 0 or names != self.groups[group]:
            raise RuntimeError(
                f"iter_groups yielded {names[:3]}{'...' if len(names) > 3 else ''}, which is not "
                "a gather group of the metadata (layerwise_groups order)"
            )
        return group

    def _held_batch(
        self, names: list[str], tensors: Sequence[torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for name, tensor in zip(names, tensors, strict=True):
            held = name in self.held
            if tensor is None:
                if held:
                    raise RuntimeError(
                        f"{name!r} is in held_names() but the source yielded None for it"
                    )
                continue
            if not held:
                raise RuntimeError(
                    f"{name!r} is not in held_names() but the source yielded a tensor for it"
                )
            meta, shape = self.meta_of[name], self.shape_of[name]
            if tensor.dtype != meta.dtype or tuple(tensor.shape) != shape:
                what = "its local piece on this rank is" if self.local else "metadata() says"
                raise ValueError(
                    f"{name!r} disagrees with metadata: the source yielded {tensor.dtype} "
                    f"{list(tensor.shape)}, {what} {meta.dtype} {list(shape)}"
                )
            batch[name] = tensor.detach() if tensor.requires_grad else tensor
        return batch

    @staticmethod
    def _check_finite(tensors: dict[str, torch.Tensor], floating: list[torch.Tensor]) -> None:
        """Refuse NaN or infinity: `floating` (the same bytes, fewer tensors) is checked;
        only a span that fails is looked at tensor by tensor, to name the parameter."""
        if first_non_finite(floating) is None:
            return
        bad = first_non_finite(list(tensors.values()))
        if bad is not None:
            raise ValueError(
                f"WeightSource yielded non-finite values (NaN or infinity) in "
                f"{list(tensors)[bad]!r}; set check_finite = False on the engine to send "
                "them anyway"
            )

    def _drain(self, in_flight: dict[int, set[int]], transfer: Transfer | None) -> None:
        """Wait for frees; drop the spans every live consumer has freed."""
        for group in self._freed(transfer):
            span = group // self.span
            waiting = in_flight.get(span)
            if waiting is not None:
                waiting.discard(group)
                if not waiting:
                    del in_flight[span]

    def _freed(self, transfer: Transfer | None) -> set[int]:
        """Groups freed by every live consumer; the workers' failure raises at once."""
        assert self.host is not None
        while True:
            freed = self.host.wait_freed(_POLL_S)
            if freed:
                return set(freed)
            if transfer is not None:
                error = transfer.worker_error()
                if error is not None:
                    raise error

    def _fail_sync(self, message: str, sync_id: int) -> None:
        """Fail sync `sync_id` at this rank's producer (the sender: at every rank's)."""
        targets: list[Any] = [self.host, *self.peers] if self.is_sender else [self.host]
        for target in targets:
            if target is None:
                continue
            try:
                target.set_error(message, sync_id)
            except Exception as error:  # a dead producer needs no notice
                logger.debug("could not notify a producer: %s", error)

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        self.peers = []


def _sends_local_shards(
    asked: bool | None, source: WeightSource, metas: Sequence[ParamMeta]
) -> bool:
    sharded = any(m.placements is not None for m in metas)
    has_local = bool(source.implements_iter_local())
    if asked is None:
        return sharded and has_local
    if asked and not has_local:
        raise ValueError(
            f"ShardedRDTTrainerInitInfo: field 'local_shards' is True, but "
            f"{type(getattr(source, 'source', source)).__name__} implements no iter_local()"
        )
    return asked


def _held_names(held: Collection[str] | None, meta_of: dict[str, ParamMeta]) -> frozenset[str]:
    if held is None:
        return frozenset(meta_of)
    held_set = frozenset(held)
    unknown = sorted(held_set - meta_of.keys())
    if unknown:
        raise ValueError(f"held_names() lists {unknown[0]!r}, which metadata() does not")
    if not held_set:
        raise ValueError(
            "held_names() is empty: this rank would serve nothing (return None for all)"
        )
    return held_set
