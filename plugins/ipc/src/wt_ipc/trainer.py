"""Trainer side of the `ipc` backend: rank 0 writes buckets into staging the workers map.

`trainer_init` (rank 0) allocates the staging buffers (shared memory for a
CPU trainer, device buffers exported by CUDA IPC for a CUDA one), each sealed
with a nonce drawn for this staging, listens on a private control socket and
runs the workers' `init_weight_transfer_engine` with the handshake; the
trainer sends each link it accepts the nonce (`SEAL`), and each worker maps
the buffers, checks their seals and says hello. Once all `num_workers` have,
the segment names are unlinked.

Re-admission (`reconnect`, called by core at a round boundary when a worker
refuses its start for want of an attachment, or when one of this side's links
has closed): the old links and staging are released and every worker is
attached again to a fresh staging, so a restarted engine rejoins at the next
`send_weights` without `trainer_init`.

Core's `ResyncTrainerEngine` drives the round; `transmit` is the data step:
send the update info's layout digests (`LAYOUT`), then for each bucket `k`,
wait until every worker released buffer `k % n` (`SendWindow` over `Credits`
futures, which also watches the workers' `update_weights` and fails at once
if a worker's link closes), pack the bucket into it (with `verify`, its
digests into the buffer's digest room), publish, send `READY`. A round that
fails with every link intact sends `ABORT`, so workers still waiting end it at
once. Every frame names its round, so any failure other than a closed link
leaves the link able to carry the next round.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch

from weight_transfer.backend import (
    AlignedFailure,
    ParamMeta,
    ResyncTrainerEngine,
    TrainerInitInfo,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    check_int_range,
    check_timeout,
    device_name,
    param_list_digests,
    param_list_payload,
    payload_of,
    trainer_device,
)
from wt_ipc.planes import TrainerStaging
from wt_ipc.protocol import (
    ABORT,
    HELLO,
    LAYOUT,
    MAX_WORKERS,
    READY,
    SEAL,
    IPCWorkerInitInfo,
    StagingSeal,
    digest_room,
    plan_for,
)
from wt_kits.channel import GroupChannel
from wt_kits.colocated import Credits, Frame, LinkClosed, LocalLink, LocalListener
from wt_kits.stream import (
    BucketDigests,
    Packer,
    PlanCache,
    RotatingBuffers,
    SendWindow,
    WireParams,
)
from wt_kits.waits import PEER_GRACE_S, in_background

__all__ = ["IPCTrainerInitInfo", "IPCTrainerEngine"]

# Staging is reserved memory on CPU (pages of /dev/shm) and on the GPU, so it
# defaults smaller than a group backend's buffers; a bucket still closes at
# the first layer boundary after `packed_min_bucket_bytes`.
DEFAULT_IPC_BUFFER_BYTES = 256 << 20

# Time the workers' init RPC may take beyond `timeout_s` (engine-side work).
_RPC_GRACE_S = 30.0


@dataclass
class IPCTrainerInitInfo(WireParams, TrainerInitInfo):
    """How a trainer configures the `ipc` backend.

    The wire parameters size the staging: `packed_num_buffers` buffers of
    `packed_buffer_size_bytes` (256 MiB by default), allocated by rank 0 in
    packed and unpacked mode alike (unpacked puts one parameter per bucket).
    `num_workers` is how many inference workers read them (every TP rank of
    every colocated replica); `trainer_init` fails unless exactly that many
    attach. Left out (None), it is the number of workers that attach during
    the workers' init, which vLLM's `init_weight_transfer_engine` returns from
    only once every worker of the engine has: their global indexes must be
    0..n-1. A CUDA trainer must set it (it exports its buffers once per
    worker before any attaches). `device` is where the source's tensors live (a
    string, a `torch.device` or a CUDA index) and picks the plane: CPU ->
    shared memory, CUDA -> CUDA IPC (default: the current CUDA device when
    there is one).
    """

    backend: ClassVar[str] = "ipc"
    packed_buffer_size_bytes: int = DEFAULT_IPC_BUFFER_BYTES
    num_workers: int | None = field(default=None, kw_only=True)
    timeout_s: float = field(default=300.0, kw_only=True)
    device: str | torch.device | int | None = field(default=None, kw_only=True)
    replace_trainer: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        what = type(self).__name__
        check_timeout(self.timeout_s, field="timeout_s", what=what)
        self.device = device_name(self.device, what=what)
        if self.num_workers is not None:
            check_int_range(
                self.num_workers, field="num_workers", what=what, low=1, high=MAX_WORKERS
            )
        self.validate(what, staged=True)
        if self.verify:
            digest_room(self, what)

    def resolved_device(self) -> torch.device:
        return trainer_device(cast("str | None", self.device))  # a string since __post_init__


class IPCTrainerEngine(ResyncTrainerEngine[IPCTrainerInitInfo]):
    init_info_cls = IPCTrainerInitInfo
    finite_per_bucket = True

    def __init__(
        self,
        *,
        info: IPCTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> None:
        super().__init__(info=info, client=client, source=source)
        self.info: IPCTrainerInitInfo = info
        self.wire = info.wire
        self.device = info.resolved_device()
        self.channel: GroupChannel[Credits] = GroupChannel(
            "ipc", remedy="the next send_weights attaches the workers again (or call trainer_init)"
        )
        self.staging: TrainerStaging | None = None
        self.slots: RotatingBuffers | None = None  # the staging's buffers, with their views
        self.round_id = 0
        self.layout_digests: list[int] = []  # the last update info's, sent in its round
        self.plan_for = PlanCache(lambda metas: plan_for(metas, self.wire))

    def connect(self) -> None:
        """Allocate the staging and attach every worker (see the module docstring)."""
        self._attach_workers(replace=self.info.replace_trainer)

    def reconnect(self) -> None:
        """Attach every worker again, to a fresh staging (at a round boundary).

        The old links and staging go first (shared-memory names cannot be
        mapped again once unlinked; each CUDA export pairs with one open). A
        failure leaves this side without a channel and nothing in /dev/shm;
        the next `send_weights` tries again. Never takes an engine over: a
        trainer that took this one over since keeps it.
        """
        self.channel.close("it is being attached again")
        if self.staging is not None:
            self.staging.close()
            self.staging, self.slots = None, None
        self._attach_workers(replace=False)

    def _attach_workers(self, *, replace: bool) -> None:
        info = self.info
        plane = "cuda" if self.device.type == "cuda" else "shm"
        if plane == "cuda" and info.num_workers is None:
            raise ValueError(
                "IPCTrainerInitInfo: field 'num_workers' must be set for a CUDA trainer (its "
                "buffers are exported once per worker before any attaches)"
            )
        nonce = secrets.randbits(63)
        staging = TrainerStaging.create(
            plane,
            info.packed_num_buffers,
            info.packed_buffer_size_bytes,
            self.device,
            readers=info.num_workers or 0,
            seal=StagingSeal(self.wire, self.trainer_id, nonce),
        )
        listener: LocalListener | None = None
        links: list[LocalLink] = []
        try:
            listener = LocalListener()
            payload = payload_of(
                IPCWorkerInitInfo(
                    **vars(self.wire),
                    plane=plane,
                    control_path=listener.path,
                    trainer_pid=os.getpid(),
                    timeout_s=info.timeout_s,
                    trainer_id=self.trainer_id,
                    replace=replace,
                    **staging.fields(),
                )
            )
            links = self._accept(listener, payload, nonce)
            staging.attached()
        except BaseException:
            for link in links:
                link.close()
            staging.close()
            raise
        finally:
            if listener is not None:
                listener.close()
        self.staging, self.slots = staging, RotatingBuffers.over(staging.slots)
        self.channel.connect(Credits(links))

    def _accept(
        self, listener: LocalListener, payload: dict[str, Any], nonce: int
    ) -> list[LocalLink]:
        """Run the workers' init while accepting their links (each is told the staging's
        `nonce` first); check their hellos."""
        rpc = in_background(
            lambda: self.client.init_weight_transfer_engine(payload), name="wt-init-rpc"
        )
        links: list[LocalLink] = []

        def take(link: LocalLink) -> None:
            links.append(link)
            with contextlib.suppress(LinkClosed):  # a worker gone: its init fails, not ours here
                link.send(Frame(SEAL, -1, 0, nonce))

        try:
            deadline = time.monotonic() + self.info.timeout_s + _RPC_GRACE_S
            while not rpc.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the workers' init_weight_transfer_engine did not answer within "
                        f"{self.info.timeout_s + _RPC_GRACE_S:g}s"
                    )
                link = listener.accept(0.05)
                if link is not None:
                    take(link)
            rpc.result()  # raises the workers' error
            while (link := listener.accept(0.0)) is not None:
                take(link)
            self._check_hellos(links)
        except BaseException:
            for link in links:
                link.close()
            raise
        return links

    def _check_hellos(self, links: list[LocalLink]) -> None:
        expected = self.info.num_workers if self.info.num_workers is not None else len(links)
        if not links:
            raise ValueError("no worker attached during the workers' init_weight_transfer_engine")
        if len(links) != expected:
            raise ValueError(
                f"IPCTrainerInitInfo: field 'num_workers' is {expected}, but {len(links)} "
                "workers attached (count every TP rank of every colocated replica)"
            )
        seen: dict[int, int] = {}
        for link in links:
            hello = link.recv(self.info.timeout_s, "a worker's hello")
            if hello.kind != HELLO or hello.value != link.peer_pid:
                raise RuntimeError(f"{link.name} did not say hello on the control link")
            if hello.index in seen or not 0 <= hello.index < expected:
                raise ValueError(
                    f"IPCTrainerInitInfo: workers attached with global indexes "
                    f"{sorted([*seen, hello.index])}; with num_workers={expected} each of "
                    f"0..{expected - 1} must attach once"
                )
            seen[hello.index] = link.peer_pid
            link.name = f"worker {hello.index} (pid {link.peer_pid})"

    def check_ready(self) -> None:
        """`ChannelDownError` (which makes core `reconnect`) unless every link is open."""
        workers = self.channel.require()
        if not workers.healthy:
            self.channel.drop(f"a worker's control link closed ({workers.failure})")
            self.channel.require()

    def update_info(self, metas: list[ParamMeta]) -> dict[str, Any]:
        """The round's update info; its layout digests go out first in the round (`LAYOUT`)."""
        self.round_id += 1
        declared = param_list_payload(metas)
        self.layout_digests = param_list_digests(declared)
        return {**declared, "trainer_id": self.trainer_id, "round_id": self.round_id}

    def num_chunks(self, metas: list[ParamMeta]) -> int:
        return len(self.plan_for(metas).buckets)

    def transmit(
        self,
        metas: list[ParamMeta],
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        transfer: Transfer,
    ) -> None:
        plan = self.plan_for(metas)
        staging, slots = self.staging, self.slots
        assert staging is not None and slots is not None
        round_id = self.round_id
        room = digest_room(self.wire) if self.wire.verify else None
        digests = BucketDigests.of_plan(plan) if room is not None else None
        with self.channel.on_wire("a round") as workers:
            workers.begin(round_id)
            window = SendWindow(slots, transfer)
            packer = Packer(plan, pairs, finite=self.check_finite)
            k = 0
            try:
                for i, value in enumerate(self.layout_digests):
                    workers.send(Frame(LAYOUT, round_id, i, value))
                for k, bucket in enumerate(plan.buckets):
                    window.free(k)
                    try:  # only the source can fail here: tell the workers
                        out = packer.pack(k, slots)
                        if k == len(plan.buckets) - 1:
                            packer.exhaust()
                    except Exception as error:
                        workers.send(Frame(ABORT, round_id, k, 0))
                        raise AlignedFailure(error) from error
                    if room is not None and digests is not None:
                        slot = staging.slots[k % len(staging.slots)]
                        room.view(slot, len(bucket.pieces)).copy_(digests.of(k, out))
                    staging.publish()
                    workers.send(Frame(READY, round_id, k, bucket.nbytes))
                    window.sent(k, [workers.released(round_id, k)], [])
                    transfer.chunk_moved(bucket.nbytes)
                if not plan.buckets:
                    packer.exhaust()
                window.drain("the workers' release of the last buckets")
            except AlignedFailure:
                raise
            except Exception as error:
                if workers.healthy and _tell_abort(workers, round_id, k):
                    raise AlignedFailure(error) from error  # every frame names its round
                reported = transfer.worker_error(within_s=PEER_GRACE_S)
                if reported is not None and reported is not error:
                    raise reported from error  # why the worker closed its link
                raise

    def shutdown(self) -> None:
        self.channel.close()
        if self.staging is not None:
            self.staging.close()
            self.staging, self.slots = None, None


def _tell_abort(workers: Credits, round_id: int, k: int) -> bool:
    """Send `ABORT(round_id, k)` to every worker (those still waiting end the round at
    once, the others skip it); False if a link turned out to be closed."""
    try:
        workers.send(Frame(ABORT, round_id, k, 0))
    except LinkClosed:
        return False
    return True
