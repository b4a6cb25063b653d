# vLLM's documented "Implementing a Custom Engine" (steps 1 and 2), with these changes only:
# - imports: `vllm.distributed.weight_transfer.base` -> `weight_transfer.base`, and
#   `import torch`, which the documented snippet uses without importing;
# - the `...` in `init_transfer_engine` is filled in, and `_fetch_weight` (which
#   the documentation calls but does not show) is written: it reads the file the trainer's
#   transmit writes. The other `...` bodies stay as the documentation has them: the
#   transaction around the model is the base class's.
from dataclasses import dataclass
from weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import os
import time
import torch

FETCH_TIMEOUT_S = 60.0


@dataclass
class MyInitInfo(WeightTransferInitInfo):
    endpoint: str
    chunk_size_bytes: int = 256 * 1024 * 1024  # must-agree wire param


@dataclass
class MyUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # Per-round metadata only.


class MyWeightTransferEngine(WeightTransferEngine[MyInitInfo, MyUpdateInfo]):
    init_info_cls = MyInitInfo
    update_info_cls = MyUpdateInfo

    def init_transfer_engine(self, init_info: MyInitInfo) -> None:
        # Record the trainer's wire params, then set up the connection.
        self.chunk_size_bytes = init_info.chunk_size_bytes
        self.endpoint = init_info.endpoint

    def start_weight_update(self) -> None:
        # Checkpoint-format engines: run initialize_layerwise_reload(self.model).
        # In-place engines: no-op
        ...

    def finish_weight_update(self) -> None:
        # Checkpoint-format engines: run finalize_layerwise_reload(...).
        # In-place engines: no-op
        ...

    def receive_weights(self, update_info: MyUpdateInfo) -> None:
        weights = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes
        ):
            dtype = getattr(torch, dtype_name)
            weight = self._fetch_weight(name, shape, dtype)
            weights.append((name, weight))
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        # Clean up resources
        ...

    def _fetch_weight(self, name, shape, dtype):
        path = os.path.join(self.endpoint, name + ".pt")
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"my_backend: {name!r} did not arrive")
            time.sleep(0.002)
        weight = torch.load(path, weights_only=True).to(self.device)
        os.unlink(path)
        if weight.dtype != dtype or list(weight.shape) != list(shape):
            raise ValueError(f"my_backend: {name!r} arrived as {weight.dtype} {list(weight.shape)}")
        return weight
