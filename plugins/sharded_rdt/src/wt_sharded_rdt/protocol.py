"""What trainer ranks, producers and consumers of `sharded_rdt` agree on.

Handshake (`ShardedRDTWorkerInitInfo`, JSON-safe, built by the sender rank
from what every rank's producer declared): the whole model's metadata in
metadata order, its partition into gather groups (`group_lens`, consecutive
runs of `layerwise_groups`), who holds what (`owner_sets`: distinct sorted
sets of trainer ranks; `name_owner_class[i]`: the set holding name `i`), the
producers' names and where to find them (Ray namespace and cluster
address, for nixl), the transport, the ring depth, the timeouts, and this
replica's identity (`replica_rank`, filled in by the trainer per replica),
`verify` (opt-in verified bytes, below), and with local shards the layout of
each sharded parameter (`shard_layouts`: owners, mesh, placements; its slices
are pulled in pieces, `wt_sharded_rdt.shards`).

Update info (`ShardedRDTUpdateInfo`): the trainer, the sync's number, and the
live consumers (empty: all). There is no per-sync layout: each consumer's
plan is static (`build_plan`), derived once from the handshake and its own
dry run; a pull names its slices (`FetchKey`s) and the layout both ends
derive from them (`blob_layout`: `aligned_layout` over the slices' sizes).

Verified bytes (`verify`): the producer digests every slice of a blob as it
lies in the serve slot (core's `BucketDigests`, one `int64[S1, S2]` row per
slice) and writes the rows after the slices, at the next aligned offset
(`blob_layout`: the digest room is one more piece of the same layout, so
both ends derive it and nothing else travels). The consumer checks a landed
blob against them before scattering any of it; a mismatch names the
parameter, the pull and the producer.

Consumer id: `replica_rank * workers_per_replica + worker.global_index`,
unique across the fleet; it keys the producers' serve rings.

Routing (`Router`) is the consumers' business: a pull for group `g` of names
held by owner set `S` goes to `S[(consumer_id + g) % len(S)]`, which spreads
consumers over the ranks holding the same names and a consumer's groups over
its candidates. Every owner of a group counts one free per live consumer per
sync; a group is released (its tensors dropped) when all have arrived.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weight_transfer.backend import (
    ParamMeta,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    WireProtocolInfo,
    check_int_range,
    check_timeout,
    dtype_from_name,
    dtype_name,
)
from wt_kits.slices import FetchKey, Scatter, SliceRecord
from wt_kits.stream import (
    DIGEST_DTYPE,
    Bucket,
    BucketDigests,
    BucketPlan,
    Piece,
    aligned_layout,
)
from wt_sharded_rdt.shards import decode_layout, encode_layout, shard_pieces

__all__ = [
    "TRANSPORTS",
    "MAX_CONSUMERS",
    "MAX_PRODUCERS",
    "ShardedRDTWorkerInitInfo",
    "ShardedRDTUpdateInfo",
    "metadata_digest",
    "owner_table",
    "Router",
    "Chunk",
    "ConsumerPlan",
    "build_plan",
    "auto_lookahead",
    "pull_span",
    "chunk_expectation",
    "BlobLayout",
    "blob_layout",
    "blob_digests",
    "plan_digests",
    "digests_view",
]

TRANSPORTS = ("nixl", "loopback")
MAX_CONSUMERS = 4096
MAX_PRODUCERS = 4096
DEFAULT_CHUNK_BYTES = 256 << 20
# What the trainer's staging ring may hold when `gather_lookahead` is left to it
STAGING_BUDGET_BYTES = 512 << 20
# A sanity bound on `gather_lookahead`: memory (the budget above) bounds it in practice
MAX_LOOKAHEAD = 1 << 16


def auto_lookahead(group_bytes: Sequence[int], budget: int = STAGING_BUDGET_BYTES) -> int:
    """Groups published ahead of the one being gathered when the trainer leaves it
    open: as many as `budget` holds beside it at the largest group's size, at least
    1 and at most `MAX_LOOKAHEAD`. A function of the metadata alone, so every rank
    derives the same."""
    largest = max(group_bytes, default=0)
    if largest <= 0:
        return 1
    return max(1, min(MAX_LOOKAHEAD, budget // largest - 1))


def pull_span(lookahead: int) -> int:
    """Consecutive groups one pull (and one publish) may hold: half of what the trainer
    keeps published (`lookahead + 1`), so the next span is staged while one is pulled."""
    return max(1, (lookahead + 1) // 2)


def metadata_digest(metas: Sequence[ParamMeta]) -> str:
    """A digest of the names, dtypes, shapes and shard layouts, in order (ranks must
    agree on it)."""
    h = hashlib.sha256(str(len(metas)).encode())
    for m in metas:
        h.update(f"\n{m.name}|{dtype_name(m.dtype)}|{list(m.shape)}".encode())
        if m.placements is not None:
            h.update(f"|{encode_layout(m)}".encode())
    return h.hexdigest()[:32]


def owner_table(
    names: Sequence[str], held: Sequence[Sequence[bool]]
) -> tuple[list[list[int]], list[int]]:
    """`(owner_sets, name_owner_class)` from each rank's held mask over `names`.

    Classes are numbered by first appearance, a pure function of the masks,
    so a rebuilt handshake is identical. Raises `ValueError` naming the first
    name no rank holds.
    """
    sets: dict[tuple[int, ...], int] = {}
    classes: list[int] = []
    for i, name in enumerate(names):
        owners = tuple(r for r, mask in enumerate(held) if mask[i])
        if not owners:
            raise ValueError(
                f"no trainer rank holds {name!r} (held_names() of every rank leaves it out); "
                "it could never be served"
            )
        classes.append(sets.setdefault(owners, len(sets)))
    return [list(s) for s in sets], classes


@dataclass
class ShardedRDTWorkerInitInfo(WireProtocolInfo, WeightTransferInitInfo):
    """The handshake a consumer receives; see the module docstring."""

    transport: str = "nixl"
    producer_names: list[str] = field(default_factory=list)
    namespace: str | None = None
    ray_address: str | None = None
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_lens: list[int] = field(default_factory=list)
    owner_sets: list[list[int]] = field(default_factory=list)
    name_owner_class: list[int] = field(default_factory=list)
    num_consumers: int = 1
    workers_per_replica: int = 1
    replica_rank: int = 0
    num_rdt_buffers: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    gather_lookahead: int = 1
    stall_timeout_s: float = 300.0
    peer_timeout_s: float = 30.0
    timeout_s: float = 300.0
    trainer_id: str = ""
    replace: bool = False
    verify: bool = False
    shard_layouts: dict[str, list[list[int]]] = field(default_factory=dict)
    metas: list[ParamMeta] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        what = "init_info"
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"{what}: field 'transport' must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        check_int_range(
            self.gather_lookahead, field="gather_lookahead", what=what, low=0, high=MAX_LOOKAHEAD
        )
        check_int_range(
            len(self.producer_names), field="producer_names", what=what, low=1, high=MAX_PRODUCERS
        )
        for name in ("dtype_names", "shapes", "name_owner_class"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(
                    f"{what}: field {name!r} has {len(getattr(self, name))} entries, "
                    f"'names' has {len(self.names)}"
                )
        if any(n <= 0 for n in self.group_lens) or sum(self.group_lens) != len(self.names):
            raise ValueError(
                f"{what}: field 'group_lens' must be positive and sum to the {len(self.names)} "
                f"names, got {self.group_lens[:8]}{'...' if len(self.group_lens) > 8 else ''} "
                f"(sum {sum(self.group_lens)})"
            )
        for i, owners in enumerate(self.owner_sets):
            if not owners or sorted(set(owners)) != list(owners) or not all(
                0 <= r < len(self.producer_names) for r in owners
            ):  # fmt: skip
                raise ValueError(
                    f"{what}: field 'owner_sets[{i}]' must be a non-empty sorted set of producer "
                    f"indexes below {len(self.producer_names)}, got {owners}"
                )
        for i, c in enumerate(self.name_owner_class):
            if not 0 <= c < len(self.owner_sets):
                raise ValueError(
                    f"{what}: field 'name_owner_class[{i}]' is {c}, there are "
                    f"{len(self.owner_sets)} owner sets"
                )
        check_int_range(
            self.num_consumers, field="num_consumers", what=what, low=1, high=MAX_CONSUMERS
        )
        check_int_range(
            self.workers_per_replica,
            field="workers_per_replica",
            what=what,
            low=1,
            high=self.num_consumers,
        )
        check_int_range(
            self.replica_rank,
            field="replica_rank",
            what=what,
            low=0,
            high=self.num_consumers // self.workers_per_replica - 1,
        )
        check_int_range(self.num_rdt_buffers, field="num_rdt_buffers", what=what, low=1, high=16)
        check_int_range(self.chunk_bytes, field="chunk_bytes", what=what, low=1 << 10, high=1 << 40)
        for name in ("stall_timeout_s", "peer_timeout_s", "timeout_s"):
            check_timeout(getattr(self, name), field=name, what=what)
        if not isinstance(self.shard_layouts, dict):
            raise ValueError(
                f"{what}: field 'shard_layouts' must map names to layouts, got "
                f"{type(self.shard_layouts).__name__}"
            )
        self.metas = []
        for i, (n, d, s) in enumerate(zip(self.names, self.dtype_names, self.shapes, strict=True)):
            if any(x < 0 for x in s):
                raise ValueError(f"{what}: field 'shapes[{i}]' has a negative dimension")
            meta = ParamMeta(n, dtype_from_name(d, field=f"dtype_names[{i}]"), tuple(s))
            layout = self.shard_layouts.get(n)
            if layout is not None:
                meta = decode_layout(
                    meta, layout, field=f"shard_layouts[{n}]", ranks=len(self.producer_names)
                )
            self.metas.append(meta)
        unknown = sorted(set(self.shard_layouts) - set(self.names))
        if unknown:
            raise ValueError(
                f"{what}: field 'shard_layouts' names {unknown[0]!r}, which 'names' does not"
            )

    def groups(self) -> list[list[str]]:
        out: list[list[str]] = []
        start = 0
        for n in self.group_lens:
            out.append(self.names[start : start + n])
            start += n
        return out


@dataclass
class ShardedRDTUpdateInfo(WeightTransferUpdateInfo):
    """One sync: the trainer, its number, the live consumers (empty: all).

    `sync_id` must be positive and `live_consumers` strictly increasing and
    non-negative (`ValueError` naming the field); the worker also checks them
    against its handshake and its own history.
    """

    trainer_id: str = ""
    sync_id: int = 0
    live_consumers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sync_id < 1:
            raise ValueError(f"update_info: field 'sync_id' must be positive, got {self.sync_id}")
        live = self.live_consumers
        if any(c < 0 for c in live) or any(a >= b for a, b in itertools.pairwise(live)):
            raise ValueError(
                "update_info: field 'live_consumers' must be strictly increasing consumer ids, "
                f"got {live[:8]}{'...' if len(live) > 8 else ''}"
            )


class Router:
    """Which producer serves a consumer's pull, and who counts its frees.

    A sharded parameter among `metas` (local shards: placements declared) is
    pulled in pieces (`shard_pieces`), each from the owners holding it; its
    owner sets join `owner_sets` as they are first met.
    """

    def __init__(
        self,
        owner_sets: Sequence[Sequence[int]],
        name_owner_class: Sequence[int],
        names: Sequence[str],
        metas: Sequence[ParamMeta] = (),
    ) -> None:
        self.owner_sets = [list(s) for s in owner_sets]
        self.class_of = dict(zip(names, name_owner_class, strict=True))
        self.sharded = {m.name: m for m in metas if m.placements is not None}
        self._set_index = {tuple(s): i for i, s in enumerate(self.owner_sets)}

    def pieces(self, name: str, scatter: Scatter) -> list[tuple[int, Scatter]]:
        """What a consumer pulls for `scatter`: `(owner class, scatter)` pairs."""
        meta = self.sharded.get(name)
        if meta is None:
            return [(self.class_of[name], scatter)]
        out = []
        for owners, piece in shard_pieces(meta, scatter):
            index = self._set_index.setdefault(tuple(owners), len(self.owner_sets))
            if index == len(self.owner_sets):
                self.owner_sets.append(list(owners))
            out.append((index, piece))
        return out

    def owners(self, name: str) -> list[int]:
        return self.owner_sets[self.class_of[name]]

    def producer_for(self, consumer_id: int, owner_class: int, group: int) -> int:
        owners = self.owner_sets[owner_class]
        return owners[(consumer_id + group) % len(owners)]

    def group_owners(self, names: Sequence[str]) -> list[int]:
        return sorted({r for n in names for r in self.owners(n)})


@dataclass(frozen=True)
class BlobLayout:
    """Where a pull's slices lie in its blob (`offsets`), where their digests do
    (`digests_at`, `None` without verify), and the blob's length."""

    offsets: list[int]
    digests_at: int | None
    nbytes: int

    @property
    def data_bytes(self) -> int:
        """The bytes the slices span (the digests lie beyond)."""
        return self.digests_at if self.digests_at is not None else self.nbytes


DIGEST_ROW_BYTES = 2 * DIGEST_DTYPE.itemsize


def blob_layout(sizes: Sequence[int], verify: bool) -> BlobLayout:
    """The layout of a blob of slices of `sizes` bytes (`aligned_layout`); with
    `verify` the digest rows (`int64[len(sizes), 2]`) are one more piece after them."""
    if not verify:
        offsets, nbytes = aligned_layout(sizes)
        return BlobLayout(offsets, None, nbytes)
    offsets, nbytes = aligned_layout([*sizes, DIGEST_ROW_BYTES * len(sizes)])
    return BlobLayout(offsets[:-1], offsets[-1], nbytes)


def digests_view(blob: torch.Tensor, layout: BlobLayout) -> torch.Tensor:
    """The `int64[slices, 2]` digest rows inside `blob` (a flat uint8 tensor)."""
    if layout.digests_at is None:
        raise ValueError("this blob carries no digests (verify is off)")
    rows = len(layout.offsets)
    region = blob[layout.digests_at : layout.digests_at + DIGEST_ROW_BYTES * rows]
    return region.view(DIGEST_DTYPE).view(rows, 2)


def plan_digests(blobs: Sequence[Sequence[tuple[str, int]]]) -> BucketDigests:
    """Core's `BucketDigests` over verified blobs of `(parameter name, slice bytes)`:
    blob `k` is bucket `k`, so `of(k, blob)` digests its slices where they lie."""
    params: list[ParamMeta] = []
    buckets: list[Bucket] = []
    for slices in blobs:
        layout = blob_layout([size for _, size in slices], verify=True)
        pieces = []
        for (name, size), offset in zip(slices, layout.offsets, strict=True):
            pieces.append(Piece(param=len(params), start=0, nbytes=size, offset=offset))
            params.append(ParamMeta(name, torch.uint8, (size,)))
        buckets.append(Bucket(tuple(pieces), layout.data_bytes))
    return BucketDigests(BucketPlan(tuple(params), tuple(buckets), (0,) * len(params)))


@functools.lru_cache(maxsize=1024)
def blob_digests(sizes: tuple[int, ...]) -> BucketDigests:
    """The producer's digester of a verified blob of slices of `sizes` bytes (bucket 0),
    kept per layout: a consumer pulls the same layouts every sync."""
    return plan_digests([[("", size) for size in sizes]])


@dataclass
class Chunk:
    """One pull: slices `keys` from producer `owner`, of one or more consecutive
    groups (`group`: the first; `build_plan`'s spans).

    `offsets`/`nbytes` are the layout of the pulled blob (`blob_layout` over
    each slice's bytes), `digests_at` where its digest rows lie (verify only);
    `scatters[i]` are where slice `i` lands. Before
    applying it, `begins` modules are materialized; after, `ends` are
    processed. `frees` are the groups freed once it lands (its span's, on the span's
    last chunk).
    """

    index: int
    group: int
    owner: int
    seq: int
    keys: list[FetchKey]
    dtypes: list[str]
    numels: list[int]
    offsets: list[int]
    nbytes: int
    scatters: list[list[Scatter]]
    begins: list[str] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    digests_at: int | None = None
    last_group: int = -1  # the last of its groups (-1: `group` alone)

    @property
    def groups_text(self) -> str:
        """`group 3`, or `groups 3-6` for a pull of several."""
        if self.last_group <= self.group:
            return f"group {self.group}"
        return f"groups {self.group}-{self.last_group}"

    @property
    def layout(self) -> BlobLayout:
        return BlobLayout(self.offsets, self.digests_at, self.nbytes)


@dataclass
class ConsumerPlan:
    """A consumer's static plan: its chunks in issue order, and the groups it
    frees before pulling anything (those it needs nothing from)."""

    chunks: list[Chunk]
    pre_free: list[int]
    group_owners: list[list[int]]

    @property
    def max_chunk_bytes(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)

    def bytes_from(self) -> dict[int, int]:
        """The largest chunk pulled from each producer (its serve slots' size)."""
        out: dict[int, int] = {}
        for c in self.chunks:
            out[c.owner] = max(out.get(c.owner, 0), c.nbytes)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def digests(self) -> BucketDigests:
        """The checker of this plan's verified blobs: bucket `k` is chunk `k`, its
        pieces the chunk's slices under their parameters' names."""
        return plan_digests(
            [
                [(key[0], s[0].nbytes) for key, s in zip(c.keys, c.scatters, strict=True)]
                for c in self.chunks
            ]
        )


def chunk_expectation(chunk: Chunk) -> list[tuple[str, int]]:
    return list(zip(chunk.dtypes, chunk.numels, strict=True))


def build_plan(
    record: SliceRecord,
    groups: Sequence[Sequence[str]],
    router: Router,
    consumer_id: int,
    chunk_bytes: int,
    verify: bool = False,
    span: int = 1,
) -> ConsumerPlan:
    """Cut the recorded slices into pulls: the groups in spans (groups `[i * span,
    (i + 1) * span)`), per span one pull per producer present, split at `chunk_bytes`
    (a slice larger than that is a pull of its own); with `verify` each blob also
    carries its digest rows (`blob_layout`).

    A pull never holds groups of two spans, and a span's groups are freed after its
    last pull. Spans are windows of the group indices, the same for every consumer,
    so a span never reaches more than `span - 1` groups past its first: a trainer
    that keeps at least `span` groups published (`pull_span` of its lookahead) can
    serve every span that holds its oldest unfreed group, and no pull waits on a free
    that waits on it."""
    chunks: list[Chunk] = []
    pre_free: list[int] = []
    seq_of: dict[int, int] = {}
    first_chunk: dict[str, int] = {}
    last_chunk: dict[str, int] = {}
    Entry = tuple[FetchKey, list[Scatter], int]  # a slice, where it lands, its group
    pending: dict[int, list[Entry]] = {}  # per owner, in the span's order
    span_groups: list[int] = []

    def close_span() -> None:
        for owner, entries in pending.items():
            group_of = {k: g for k, _, g in entries}
            for piece in _split([(k, s) for k, s, _ in entries], chunk_bytes):
                layout = blob_layout([s[0].nbytes for _, s in piece], verify)
                index = len(chunks)
                chunk = Chunk(
                    index=index,
                    group=group_of[piece[0][0]],
                    owner=owner,
                    seq=seq_of.get(owner, 0),
                    keys=[k for k, _ in piece],
                    dtypes=[dtype_name(s[0].src_dtype) for _, s in piece],
                    numels=[s[0].numel for _, s in piece],
                    offsets=layout.offsets,
                    nbytes=layout.nbytes,
                    scatters=[s for _, s in piece],
                    digests_at=layout.digests_at,
                    last_group=group_of[piece[-1][0]],
                )
                seq_of[owner] = chunk.seq + 1
                chunks.append(chunk)
                for _, scatters in piece:
                    for s in scatters:
                        first_chunk.setdefault(s.module, index)
                        last_chunk[s.module] = index
        if span_groups:
            chunks[-1].frees.extend(span_groups)
        pending.clear()
        span_groups.clear()

    for gi, names in enumerate(groups):
        by_class: dict[int, list[tuple[FetchKey, list[Scatter]]]] = {}
        index_of: dict[tuple[int, FetchKey], int] = {}  # a key is a chain on its owners' tensor
        for name in names:
            for whole in record.scatters.get(name, ()):
                for cls, scatter in router.pieces(name, whole):
                    entries = by_class.setdefault(cls, [])
                    if (cls, scatter.key) in index_of:
                        entries[index_of[cls, scatter.key]][1].append(scatter)
                        continue
                    index_of[cls, scatter.key] = len(entries)
                    entries.append((scatter.key, [scatter]))
        if not by_class:
            pre_free.append(gi)
            continue
        if span_groups and gi // span != span_groups[0] // span:
            close_span()
        span_groups.append(gi)
        for cls in sorted(by_class):
            owner = router.producer_for(consumer_id, cls, gi)
            pending.setdefault(owner, []).extend((k, s, gi) for k, s in by_class[cls])
    close_span()
    for module, index in first_chunk.items():
        chunks[index].begins.append(module)
    for module, index in last_chunk.items():
        chunks[index].ends.append(module)
    return ConsumerPlan(chunks, pre_free, [router.group_owners(g) for g in groups])


def _split(
    entries: list[tuple[FetchKey, list[Scatter]]], chunk_bytes: int
) -> list[list[tuple[FetchKey, list[Scatter]]]]:
    pieces: list[list[tuple[FetchKey, list[Scatter]]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry[1][0].nbytes
        if pieces[-1] and size + nbytes > chunk_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(entry)
        size += nbytes
    return pieces
