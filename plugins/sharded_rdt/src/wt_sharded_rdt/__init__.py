"""wt backend `sharded_rdt`: pull-based, slice-exact transfer for sharded inference.

Import the pieces from their modules (`wt_sharded_rdt.trainer`,
`wt_sharded_rdt.worker`) or from here; importing this package imports
neither engine until it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_transfer.backend import lazy_exports

if TYPE_CHECKING:
    from wt_sharded_rdt.protocol import ShardedRDTUpdateInfo, ShardedRDTWorkerInitInfo
    from wt_sharded_rdt.trainer import ShardedRDTTrainerEngine, ShardedRDTTrainerInitInfo
    from wt_sharded_rdt.worker import ShardedRDTWorkerEngine

__all__ = [
    "ShardedRDTTrainerInitInfo",
    "ShardedRDTTrainerEngine",
    "ShardedRDTWorkerEngine",
    "ShardedRDTWorkerInitInfo",
    "ShardedRDTUpdateInfo",
]

_HOMES = {
    "ShardedRDTTrainerInitInfo": "wt_sharded_rdt.trainer",
    "ShardedRDTTrainerEngine": "wt_sharded_rdt.trainer",
    "ShardedRDTWorkerEngine": "wt_sharded_rdt.worker",
    "ShardedRDTWorkerInitInfo": "wt_sharded_rdt.protocol",
    "ShardedRDTUpdateInfo": "wt_sharded_rdt.protocol",
}


# vLLM's names for the same classes (`vllm.distributed.weight_transfer`), for ported code
VLLM_NAMES = {
    "ShardedRDTWeightTransferEngine": "ShardedRDTWorkerEngine",
    "ShardedRDTTrainerWeightTransferEngine": "ShardedRDTTrainerEngine",
    "ShardedRDTWeightTransferInitInfo": "ShardedRDTWorkerInitInfo",
    "ShardedRDTWeightTransferUpdateInfo": "ShardedRDTUpdateInfo",
}


__getattr__ = lazy_exports(_HOMES, VLLM_NAMES)
