"""A private group between trainer rank 0 and the workers, and its rendezvous.

A backend's `TrainerInitInfo` mixes in `GroupTrainerFields`; the trainer
runs `trainer_rendezvous(client, payload, info)`, each worker `join_group(
info, position, device)`; both get a `StatelessGroup` (gloo for CPU tensors,
NCCL for CUDA ones) over an authenticated store that admits only workers
proving the group's secret.
"""

from wt_kits.group.rendezvous import (
    GroupInitInfo,
    GroupTrainerFields,
    join_group,
    trainer_rendezvous,
)
from wt_kits.group.stateless import StatelessGroup, free_port

__all__ = [
    "GroupInitInfo",
    "GroupTrainerFields",
    "StatelessGroup",
    "free_port",
    "join_group",
    "trainer_rendezvous",
]
