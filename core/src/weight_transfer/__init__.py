"""wt: weight transfer from RL trainers into running inference engines.

Importing this package needs only torch and pluggy; `httpx`, `ray` and `vllm`
are imported by the pieces that use them, when they are used.
"""

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
from weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    LocalVLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
    WeightSyncRPCError,
)
from weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
    list_backends,
)
from weight_transfer.fleet import FanOutClient, FleetError
from weight_transfer.position import WorkerPosition
from weight_transfer.runtime.adapters import Adapter, LoRASource, remove_adapter
from weight_transfer.runtime.control import ForeignEngineError
from weight_transfer.runtime.sources import ModuleSource, StreamedSource, param_metadata
from weight_transfer.session import WorkerSession
from weight_transfer.source import (
    ParamMeta,
    Replicate,
    Shard,
    WeightSource,
    layerwise_groups,
)

__version__ = "0.1.0"

__all__ = [
    "ParamMeta",
    "Replicate",
    "Shard",
    "WeightSource",
    "ModuleSource",
    "StreamedSource",
    "param_metadata",
    "LoRASource",
    "Adapter",
    "remove_adapter",
    "layerwise_groups",
    "VLLMWeightSyncClient",
    "HTTPVLLMWeightSyncClient",
    "RayVLLMWeightSyncClient",
    "LocalVLLMWeightSyncClient",
    "WeightSyncRPCError",
    "ForeignEngineError",
    "FanOutClient",
    "FleetError",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "WeightTransferTrainerFactory",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
    "WeightTransferConfig",
    "WeightTransferEngineFactory",
    "WorkerPosition",
    "WorkerSession",
    "list_backends",
    "__version__",
]
