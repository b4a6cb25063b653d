"""wt backend `nccl`: trainer rank 0 broadcasts every parameter to every inference worker.

Import the pieces from their modules (`wt_nccl.trainer`, `wt_nccl.worker`) or
from here; importing this package imports neither engine until it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_transfer.backend import lazy_exports

if TYPE_CHECKING:
    from wt_nccl.protocol import NCCLUpdateInfo, NCCLWorkerInitInfo
    from wt_nccl.trainer import NCCLTrainerEngine, NCCLTrainerInitInfo
    from wt_nccl.worker import NCCLWorkerEngine

__all__ = [
    "NCCLTrainerInitInfo",
    "NCCLTrainerEngine",
    "NCCLWorkerEngine",
    "NCCLWorkerInitInfo",
    "NCCLUpdateInfo",
]

_HOMES = {
    "NCCLTrainerInitInfo": "wt_nccl.trainer",
    "NCCLTrainerEngine": "wt_nccl.trainer",
    "NCCLWorkerEngine": "wt_nccl.worker",
    "NCCLWorkerInitInfo": "wt_nccl.protocol",
    "NCCLUpdateInfo": "wt_nccl.protocol",
}


# vLLM's names for the same classes (`vllm.distributed.weight_transfer`), for ported code
VLLM_NAMES = {
    "NCCLWeightTransferEngine": "NCCLWorkerEngine",
    "NCCLTrainerWeightTransferEngine": "NCCLTrainerEngine",
    "NCCLWeightTransferInitInfo": "NCCLWorkerInitInfo",
    "NCCLWeightTransferUpdateInfo": "NCCLUpdateInfo",
}


__getattr__ = lazy_exports(_HOMES, VLLM_NAMES)
