"""wt-trl: TRL's trainers sync weights into vLLM through wt.

```python
import wt_trl

wt_trl.install()  # before building the trainer; the server runs `wt_nccl`
trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))
```

`install()` makes TRL build `WTVLLMClient` (TRL's client, weight methods on
wt's trainer engine); `AsyncGRPOWeightTransfer` is the same for
`trl.experimental.async_grpo` (pass it as `weight_transfer=`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wt_trl.install import SUPPORTED_TRL, install
from wt_trl.settings import settings

if TYPE_CHECKING:
    from wt_trl.async_grpo import AsyncGRPOWeightTransfer
    from wt_trl.client import WTVLLMClient

__all__ = ["install", "settings", "SUPPORTED_TRL", "WTVLLMClient", "AsyncGRPOWeightTransfer"]


def __getattr__(name: str) -> Any:  # TRL is imported only when a client is used
    if name == "WTVLLMClient":
        from wt_trl.client import WTVLLMClient

        return WTVLLMClient
    if name == "AsyncGRPOWeightTransfer":
        from wt_trl.async_grpo import AsyncGRPOWeightTransfer

        return AsyncGRPOWeightTransfer
    raise AttributeError(name)
