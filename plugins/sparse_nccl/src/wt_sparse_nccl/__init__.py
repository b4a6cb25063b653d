"""wt backend `sparse_nccl`: sparse weight patches broadcast from trainer rank 0.

Trainer: `SparseNCCLTrainerInitInfo`, `SparseNCCLTrainerEngine`,
`SparseWeightPatch`. Worker: `SparseNCCLWorkerEngine` and the `SparsePatcher`
seam (`register_patcher_provider`). Both engines are advertised through entry
points, so `weight_transfer`'s factories find them by the name `sparse_nccl`.
"""

from wt_sparse_nccl.patch import SparseWeightPatch, check_patches
from wt_sparse_nccl.trainer import SparseNCCLTrainerEngine, SparseNCCLTrainerInitInfo
from wt_sparse_nccl.wire import SparseNCCLInitInfo, SparseNCCLUpdateInfo
from wt_sparse_nccl.worker import (
    InPlacePatcher,
    MethodPatcher,
    SparseNCCLWorkerEngine,
    SparsePatcher,
    patcher_for,
    register_patcher_provider,
)

__all__ = [
    "SparseWeightPatch",
    "check_patches",
    "SparseNCCLTrainerInitInfo",
    "SparseNCCLTrainerEngine",
    "SparseNCCLInitInfo",
    "SparseNCCLUpdateInfo",
    "SparseNCCLWorkerEngine",
    "SparsePatcher",
    "InPlacePatcher",
    "MethodPatcher",
    "patcher_for",
    "register_patcher_provider",
]

# vLLM's names for the same classes (`vllm.distributed.weight_transfer`), for ported code
SparseNCCLWeightTransferEngine = SparseNCCLWorkerEngine
SparseNCCLTrainerWeightTransferEngine = SparseNCCLTrainerEngine
SparseNCCLWeightTransferInitInfo = SparseNCCLInitInfo
SparseNCCLWeightTransferUpdateInfo = SparseNCCLUpdateInfo
VLLM_NAMES = {
    "SparseNCCLWeightTransferEngine": "SparseNCCLWorkerEngine",
    "SparseNCCLTrainerWeightTransferEngine": "SparseNCCLTrainerEngine",
    "SparseNCCLWeightTransferInitInfo": "SparseNCCLInitInfo",
    "SparseNCCLWeightTransferUpdateInfo": "SparseNCCLUpdateInfo",
}
