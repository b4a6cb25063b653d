"""`trl.experimental.async_grpo` through wt: `AsyncGRPOWeightTransfer`.

`AsyncGRPOTrainer(..., weight_transfer=AsyncGRPOWeightTransfer(server_url))`
replaces TRL's own NCCL transfer (its `WeightTransferProtocol`). Each
`send_weights(iterator)` is one wt round of every tensor the iterator yields,
streamed in chunks of at most `chunk_bytes` as they come (async GRPO hands
over no metadata), committed once the iterator ends, rolled back on every
worker if anything fails; its label counts the syncs from "0" (the trainer's
`model_version` when the sync began). `pause()` and `resume()` do nothing:
each wt round pauses generation right after its start and resumes it once the
workers closed the round, so a trainer that dies between two calls never
leaves the server paused.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from weight_transfer import StreamedSource
from wt_trl.client import WTVLLMClient

__all__ = ["AsyncGRPOWeightTransfer"]

DEFAULT_CHUNK_BYTES = 256 << 20


class AsyncGRPOWeightTransfer:
    """TRL async GRPO's `WeightTransferProtocol` on wt (see the module doc):
    `server_url` is the vLLM server's, `group_port` where a group backend's
    rendezvous is hosted, `device` where the trainer's tensors live (default:
    the current CUDA device, else the CPU)."""

    def __init__(
        self,
        server_url: str,
        *,
        group_port: int = 51216,
        device: torch.device | str | int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connection_timeout: float = 240.0,
    ) -> None:
        self.server_url = server_url
        self.group_port = group_port
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.connection_timeout = connection_timeout
        self.client: WTVLLMClient | None = None
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        client = WTVLLMClient(
            base_url=self.server_url,
            group_port=self.group_port,
            connection_timeout=self.connection_timeout,
        )
        device = self.device
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        client.init_communicator(device)
        self.client = client

    def pause(self) -> None:
        """Nothing: the round pauses generation itself (see the module doc)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One round of every tensor `iterator` yields (run to its end whatever happens)."""
        if self.client is None:
            raise RuntimeError("init_weight_transfer() first")
        engine = self.client.engine
        pairs = iter(iterator)
        try:
            engine.begin()
            try:
                for chunk in _chunks(pairs, self.chunk_bytes):
                    engine.send_weight_chunk(chunk)
            except BaseException as error:
                engine.abort(f"async GRPO's weight sync failed: {error}")
                raise
            engine.end(str(self.syncs))
            self.syncs += 1
        finally:
            for _ in pairs:  # other ranks gather in step with this iteration
                pass

    def resume(self) -> None:
        """Nothing: the round resumed generation when it closed (see the module doc)."""

    def destroy(self) -> None:
        if self.client is not None:
            self.client.close_communicator()
            self.client = None


def _chunks(
    pairs: Iterator[tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[StreamedSource]:
    """`StreamedSource`s of consecutive pairs, each at most `chunk_bytes` (or one tensor)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield _streamed(chunk)
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield _streamed(chunk)


def _streamed(chunk: list[tuple[str, torch.Tensor]]) -> StreamedSource:
    return StreamedSource([(n, t.dtype, list(t.shape)) for n, t in chunk], chunk)
