"""wt backend `ipc`: colocated trainer and inference, through shared memory or CUDA IPC.

Import the pieces from their modules (`wt_ipc.trainer`, `wt_ipc.worker`) or
from here; importing this package imports neither engine until it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weight_transfer.backend import lazy_exports

if TYPE_CHECKING:
    from wt_ipc.protocol import IPCUpdateInfo, IPCWorkerInitInfo
    from wt_ipc.trainer import IPCTrainerEngine, IPCTrainerInitInfo
    from wt_ipc.worker import IPCWorkerEngine

__all__ = [
    "IPCTrainerInitInfo",
    "IPCTrainerEngine",
    "IPCWorkerEngine",
    "IPCWorkerInitInfo",
    "IPCUpdateInfo",
]

_HOMES = {
    "IPCTrainerInitInfo": "wt_ipc.trainer",
    "IPCTrainerEngine": "wt_ipc.trainer",
    "IPCWorkerEngine": "wt_ipc.worker",
    "IPCWorkerInitInfo": "wt_ipc.protocol",
    "IPCUpdateInfo": "wt_ipc.protocol",
}


# vLLM's names for the same classes (`vllm.distributed.weight_transfer`), for ported code
VLLM_NAMES = {
    "IPCWeightTransferEngine": "IPCWorkerEngine",
    "IPCTrainerWeightTransferEngine": "IPCTrainerEngine",
    "IPCWeightTransferInitInfo": "IPCWorkerInitInfo",
    "IPCWeightTransferUpdateInfo": "IPCUpdateInfo",
}


__getattr__ = lazy_exports(_HOMES, VLLM_NAMES)
