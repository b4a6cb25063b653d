"""The inference host a worker engine runs in, seen from wt-core.

wt-core names no host. A host bridge registers itself (`register_host`) in
every process it runs in; wt's vLLM plugin registers `weight_transfer.vllm`'s
in each vLLM process. A worker engine asks `host_of(vllm_config)` for the
host that owns its configuration: the host gives the round its loader
(`weight_transfer.loading.loader_for`) and its view of generation, which the
worker's round reads at start and resumes after a round its trainer left
(`weight_transfer.runtime.worker_round`). Outside any host a worker loads
through `DirectLoader` and leaves generation alone.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Host", "Generation", "register_host", "host_of"]


class Generation(Protocol):
    """The pause state and version label of the engine running a worker."""

    def paused(self) -> bool | None:
        """Whether generation is paused; None when the engine gives no answer."""

    def resume(self) -> None: ...

    def resume_when_all(self, round_id: int, rank: int, world_size: int) -> None:
        """Resume once each of the engine's `world_size` workers (this one is `rank`)
        asked for it for round `round_id` (at once for an engine of one worker)."""

    def label(self) -> str | None: ...

    def set_label(self, label: str) -> None: ...


class Host(Protocol):
    """An inference host: which worker configurations it owns, and what it gives them."""

    def owns(self, vllm_config: Any) -> bool: ...

    def loader(self, model: torch.nn.Module, vllm_config: Any, model_config: Any) -> Any:
        """The round's `WeightLoader` for `model` (`model_config`: the target's, or None)."""

    def generation(self) -> Generation | None:
        """The generation running the calling worker, asked on one of its control
        calls; None when this host cannot reach it."""

    # Optional: `adapter_loader(model, vllm_config, adapter)`, the loader of a round
    # that updates a LoRA adapter (`weight_transfer.runtime.adapters`); a host
    # without it refuses such rounds. `unsupported(vllm_config)`: why this host's
    # configuration cannot take weight updates (a string naming the feature and
    # what to change), or None; a worker refuses every init while it says so.


_hosts: list[Host] = []


def register_host(host: Host) -> None:
    """Add `host` (once per type; a later one of the same type replaces it)."""
    _hosts[:] = [h for h in _hosts if type(h) is not type(host)] + [host]


def host_of(vllm_config: Any) -> Host | None:
    """The registered host that owns `vllm_config`, if any."""
    return next((h for h in _hosts if h.owns(vllm_config)), None)
