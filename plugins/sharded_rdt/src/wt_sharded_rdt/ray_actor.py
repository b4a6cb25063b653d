"""`RDTProducer`: the producer as a Ray actor whose `serve` returns over NIXL.

Imported only by the nixl transport (it imports Ray). The class lives at
module level so that every process can import it by name: a handle resolved
with `ray.get_actor` learns which methods use tensor transport from it.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from weight_transfer.backend import FetchKey
from wt_sharded_rdt.transport import ProducerActor

__all__ = ["RDTProducer"]


class _NixlProducer(ProducerActor):
    @ray.method(tensor_transport="nixl")
    def serve(
        self,
        sync_id: int,
        consumer: int,
        seq: int,
        keys: list[FetchKey],
        expect: list[tuple[str, int]],
    ) -> list[torch.Tensor]:
        return super().serve(sync_id, consumer, seq, keys, expect)


RDTProducer: Any = ray.remote(enable_tensor_transport=True)(_NixlProducer)
