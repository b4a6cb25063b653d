"""Rendezvous of trainer rank 0 and the workers in a private group.

Trainer: a backend's `TrainerInitInfo` mixes in `GroupTrainerFields`
(address, port, world size, timeout, device); `trainer_rendezvous(client,
payload, info)` runs the workers' `init_weight_transfer_engine(payload)` on a
side thread while it hosts the rendezvous, and raises the first failure of
either at once (a worker that rejects the payload does not leave the trainer
waiting for the store timeout).

Worker: `join_group(info, position, device)` joins as rank
`rank_offset + position.global_index`. Behind a `FanOutClient` each replica
gets its own `rank_offset` (`replica_payloads`): its workers' global indexes
count from 0 within the replica.
"""

from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from weight_transfer.base import VLLMWeightSyncClient, WeightTransferInitInfo
from weight_transfer.payload import WireProtocolInfo
from weight_transfer.position import WorkerPosition
from weight_transfer.runtime.devices import device_name, trainer_device
from weight_transfer.runtime.limits import check_int_range, check_timeout
from weight_transfer.runtime.round_client import fleet_of
from weight_transfer.runtime.waiting import in_background, wait_for
from wt_kits.group.auth import check_secret, new_secret
from wt_kits.group.stateless import Hosting, StatelessGroup

__all__ = ["GroupTrainerFields", "GroupInitInfo", "trainer_rendezvous", "join_group"]

# Time the init RPC may take beyond the rendezvous timeout (engine-side work).
_RPC_GRACE_S = 30.0
_RELEASE_WAIT_S = 5.0  # for a cancelled rendezvous to close its listening socket


@dataclass
class GroupTrainerFields:
    """Trainer-side fields of a group backend, mixed into its `TrainerInitInfo`.

    `world_size` is 1 + the number of inference workers (every TP/PP rank of
    every replica). `device` is where the source's tensors live (a string, a
    `torch.device` or a CUDA index; kept as a string): `"cpu"` travels over
    gloo, `"cuda"` over NCCL; by default the current CUDA device when there is
    one. `timeout_s` bounds the rendezvous and every wait.
    An engine serves one trainer at a time: `replace_trainer=True` takes it
    over from a live one (whose next round then fails naming the new holder).
    """

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = field(default=300.0, kw_only=True)
    device: str | torch.device | int | None = field(default=None, kw_only=True)
    replace_trainer: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s, field="timeout_s", what=type(self).__name__)
        self.device = device_name(self.device, what=type(self).__name__)
        if not 0 < self.master_port < 65536:
            raise ValueError(
                f"{type(self).__name__}: field 'master_port' is not a TCP port: {self.master_port}"
            )
        if self.world_size < 2:
            raise ValueError(
                f"{type(self).__name__}: field 'world_size' must be at least 2 (the trainer "
                f"and one worker), got {self.world_size}"
            )

    def resolved_device(self) -> torch.device:
        return trainer_device(cast("str | None", self.device))  # a string since __post_init__

    def worker_group_fields(self, trainer_id: str, secret: str | None = None) -> dict[str, Any]:
        """The matching `GroupInitInfo` fields for the workers (rank offset 1).

        `secret` admits the workers to this rendezvous (`StatelessGroup`);
        None draws a fresh one (`new_secret`): call this once per rendezvous and
        send the same fields to every worker.
        """
        return {
            "trainer_id": trainer_id,
            "secret": new_secret() if secret is None else secret,
            "replace": self.replace_trainer,
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self.world_size,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
            "transport": "nccl" if self.resolved_device().type == "cuda" else "gloo",
        }


@dataclass
class GroupInitInfo(WireProtocolInfo, WeightTransferInitInfo):
    """Worker init info of a backend built on a private group (trainer = rank 0).

    Declares core's wire protocol: group backends share core's layout and codec.
    `secret` is the one the trainer drew for this rendezvous (`worker_group_fields`);
    it is required, and kept out of `repr`.
    """

    master_address: str = field(kw_only=True)
    master_port: int = field(kw_only=True)
    world_size: int = field(kw_only=True)
    rank_offset: int = field(default=1, kw_only=True)
    timeout_s: float = field(default=300.0, kw_only=True)
    transport: str = field(default="gloo", kw_only=True)
    trainer_id: str = field(default="", kw_only=True)
    replace: bool = field(default=False, kw_only=True)
    secret: str = field(default="", kw_only=True, repr=False)

    def __post_init__(self) -> None:
        if self.transport not in ("gloo", "nccl"):
            raise ValueError(
                f"init_info: field 'transport' must be 'gloo' or 'nccl', got {self.transport!r}"
            )
        if self.world_size < 2:
            raise ValueError(
                f"init_info: field 'world_size' must be at least 2, got {self.world_size}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(
                f"init_info: field 'master_port' is not a TCP port: {self.master_port}"
            )
        if not self.master_address:
            raise ValueError("init_info: field 'master_address' must not be empty")
        check_timeout(self.timeout_s, field="timeout_s", what="init_info")
        check_int_range(
            self.rank_offset, field="rank_offset", what="init_info", low=0, high=self.world_size - 1
        )
        check_secret(self.secret, what="init_info")


def trainer_rendezvous(
    client: VLLMWeightSyncClient, payload: dict[str, Any], info: GroupTrainerFields
) -> StatelessGroup:
    """Host rank 0 of the group while the workers join through `client`; see module doc.

    On failure the rendezvous is cancelled and, when this raises, rank 0 has
    stopped listening (a retry can bind the same port at once), unless its
    thread took more than `_RELEASE_WAIT_S` to return, when the port is freed as
    soon as it does.
    """
    secret = check_secret(payload.get("secret"), what="payload")
    fleet = fleet_of(client)
    if fleet is None:
        rpc = in_background(lambda: client.init_weight_transfer_engine(payload), name="wt-init-rpc")
    else:
        payloads = replica_payloads(payload, info.world_size, len(fleet.replicas))
        rpc = in_background(lambda: fleet.init_replicas(payloads), name="wt-init-rpc")
    hosting = Hosting()
    join = in_background(
        lambda: StatelessGroup.create(
            host=info.master_address,
            port=info.master_port,
            rank=0,
            world_size=info.world_size,
            secret=secret,
            trainer_id=str(payload.get("trainer_id", "")),
            device=info.resolved_device(),
            timeout_s=info.timeout_s,
            hosting=hosting,
        ),
        name="wt-rendezvous",
    )
    try:
        results = wait_for(
            {"the workers' init_weight_transfer_engine": rpc, "the rendezvous": join},
            info.timeout_s + _RPC_GRACE_S,
        )
    except BaseException:
        hosting.cancel()  # the join fails at once rather than at its timeout
        futures.wait([join], timeout=_RELEASE_WAIT_S)  # and has let the port go
        join.add_done_callback(_abort_joined)
        raise
    group: StatelessGroup = results["the rendezvous"]
    return group


def replica_payloads(
    payload: dict[str, Any], world_size: int, replicas: int
) -> list[dict[str, Any]]:
    """Per replica, `payload` with its `rank_offset`: replica `r`'s workers are
    ranks `1 + r * per_replica` onwards, where the `world_size - 1` workers
    split evenly over the replicas."""
    workers = world_size - 1
    if workers % replicas:
        raise ValueError(
            f"field 'world_size' is {world_size}: its {workers} workers do not split evenly "
            f"over the client's {replicas} replicas"
        )
    per_replica = workers // replicas
    return [{**payload, "rank_offset": 1 + r * per_replica} for r in range(replicas)]


def _abort_joined(join: Future[StatelessGroup]) -> None:
    if join.exception() is None:
        join.result().abort()


def join_group(
    info: GroupInitInfo, position: WorkerPosition, device: torch.device | str
) -> StatelessGroup:
    """Join the trainer's group as worker `position`; checks the world size first.

    The group's device follows the trainer's `transport`: "nccl" needs a CUDA
    worker and carries CUDA tensors; "gloo" carries CPU tensors whatever the
    worker's device (a CPU trainer feeding a GPU engine; the loader copies).
    """
    device = torch.device(device)
    if info.transport == "nccl" and device.type != "cuda":
        raise ValueError(
            f"init_info: field 'transport' is 'nccl', but this worker's model lives on "
            f"{device}; NCCL carries CUDA tensors only (a CPU trainer sends over gloo)"
        )
    rank = info.rank_offset + position.global_index
    if rank >= info.world_size:
        raise ValueError(
            f"init_info: field 'world_size' is {info.world_size}, but this worker "
            f"(global index {position.global_index}, rank_offset {info.rank_offset}) "
            f"would be rank {rank}; world_size must be 1 + the number of workers"
        )
    return StatelessGroup.create(
        host=info.master_address,
        port=info.master_port,
        rank=rank,
        world_size=info.world_size,
        secret=info.secret,
        trainer_id=info.trainer_id,
        device=device if info.transport == "nccl" else torch.device("cpu"),
        timeout_s=info.timeout_s,
    )
