"""TRL's `VLLMClient` with its weight methods on wt's trainer engine: `WTVLLMClient`.

Generation (`generate`, `chat`, `get_server_info`, ...) is TRL's own. The
weight methods go through a wt trainer engine of the backend the server runs
(`--weight-transfer-config '{"backend": "wt_nccl"}'`, or `wt_ipc` when the
trainer shares the server's machine), made by `init_communicator`:

- `update_named_params(metadata, named_params)`: one wt round of those tensors
  (`send_weights(source=StreamedSource(...))`), or a chunk of the round a
  `weight_update()` block holds open;
- `update_named_param(name, tensor)`: the same for one tensor;
- `weight_update()`: one round of every chunk sent inside the block, committed
  when it ends, rolled back (on every worker) when it raises;
- `update_model_params(model)`: one round of a module's parameters;
- `reset_prefix_cache()`: nothing: every wt round resets it after its finish;
- `close_communicator()`: releases the engine.

Each round is labeled with the global step of the TRL trainer that syncs
(`weight_version`: `str(state.global_step)`), pauses generation on the server
around the round and keeps wt's guarantees: a failed sync raises here with
wt's message and the server serves the previous step's weights. Tensors are
consumed as they are drawn; under DeepSpeed ZeRO-3 or FSDP1, whose gathered
parameters are freed when the next one is drawn, each is copied first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from trl.generation.vllm_client import VLLMClient

from weight_transfer import (
    HTTPVLLMWeightSyncClient,
    StreamedSource,
    TrainerInitInfo,
    WeightTransferTrainerFactory,
)
from weight_transfer.payload import dtype_name
from weight_transfer.vllm import BACKEND_PREFIX
from wt_trl.settings import settings

__all__ = ["WTVLLMClient", "FULL_RESYNC_BACKENDS"]

logger = logging.getLogger("wt_trl")

# wt backends whose trainer engine takes a round's tensors on the call (`ResyncTrainerEngine`)
FULL_RESYNC_BACKENDS = ("nccl", "ipc")


class WTVLLMClient(VLLMClient):
    """TRL's `VLLMClient`, syncing weights through wt (see the module doc). Built
    as TRL builds its client (`base_url=`, `group_port=`, `connection_timeout=`);
    `group_port` is where the trainer hosts the rendezvous of a group backend."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
    ) -> None:
        super().__init__(base_url, host, server_port, group_port, connection_timeout)
        self.engine: Any = None  # wt's trainer engine, made by init_communicator
        self._chunked = False  # inside weight_update()

    # -- the connection ---------------------------------------------------------
    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Connect wt's trainer engine of the server's backend (`device`: where the
        trainer's tensors live; TRL passes `accelerator.device`)."""
        backend = self.server_backend()
        info = self._trainer_info(backend, device)
        http = HTTPVLLMWeightSyncClient(self.base_url, timeout=settings.timeout_s)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=http)
        atexit.register(self.close_communicator)

    def server_backend(self) -> str:
        """The wt backend the server runs (`wt_<name>` in its weight-transfer config);
        `RuntimeError` naming the config to start it with otherwise."""
        config = self.get_server_info().get("weight_transfer_config") or {}
        name = str(config.get("backend", ""))
        backend = name.removeprefix(BACKEND_PREFIX)
        if not name.startswith(BACKEND_PREFIX) or backend not in FULL_RESYNC_BACKENDS:
            runs = f"runs weight-transfer backend {name!r}" if name else "has no weight transfer"
            raise RuntimeError(
                f"The vLLM server at {self.base_url} {runs}: wt-trl syncs through a wt "
                f"full-resync backend; start it with --weight-transfer-config "
                f"""'{{"backend": "wt_nccl"}}' (or "wt_ipc" on the trainer's machine)"""
            )
        return backend

    def _trainer_info(self, backend: str, device: torch.device | str | int) -> TrainerInitInfo:
        info_cls = WeightTransferTrainerFactory.get_engine_class(backend).init_info_cls
        common: dict[str, Any] = {
            "rank": 0,
            "device": device,
            "timeout_s": settings.timeout_s,
            "replace_trainer": settings.replace_trainer,
        }
        if backend == "nccl":
            from vllm.utils.network_utils import get_ip  # the address TRL's own client uses

            world_size = 1 + self.get_world_size()
            return info_cls(get_ip(), self.group_port, world_size, **common)  # type: ignore[call-arg]
        return info_cls(**common)

    def close_communicator(self) -> None:
        """Release wt's trainer engine (the server serves on; a new trainer may connect)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()

    # -- weights ------------------------------------------------------------------
    def update_named_params(
        self,
        metadata: list[tuple[str, str, list[int]]],
        named_params: Iterator[tuple[str, torch.Tensor]],
    ) -> None:
        """Send `named_params` (described, in order, by `metadata`) as one round, or as
        a chunk of the `weight_update()` round. The iterator is always run to its
        end (TRL unmerges a PEFT adapter there, and other ranks gather with it)."""
        engine = self._engine()
        pairs = _drawn(named_params, copy=_copies_needed())
        try:
            source = StreamedSource(metadata, pairs)
            if self._chunked:
                engine.send_weight_chunk(source)
            else:
                engine.send_weights(training_step(), source=source)
        finally:
            for _ in pairs:  # what a failed round left undrawn
                pass

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """`update_named_params` of one tensor."""
        self.update_named_params(
            [(name, dtype_name(weights.dtype), list(weights.shape))], iter([(name, weights)])
        )

    def update_model_params(self, model: torch.nn.Module) -> None:
        """One round of `model`'s parameters."""
        named = list(model.named_parameters())
        metadata = [(n, dtype_name(p.dtype), list(p.shape)) for n, p in named]
        self.update_named_params(metadata, ((n, p.data) for n, p in named))

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """One round for every `update_named_param(s)` call inside the block: committed
        when the block ends, rolled back on every worker when it raises."""
        engine = self._engine()
        if self._chunked:
            raise RuntimeError("weight_update() blocks do not nest")
        engine.begin()
        self._chunked = True
        try:
            yield
        except BaseException as error:
            engine.abort(f"the trainer's weight_update() block raised: {error}")
            raise
        else:
            engine.end(training_step())
        finally:
            self._chunked = False

    def reset_prefix_cache(self) -> None:
        """Nothing: every wt round resets the server's prefix cache after its finish."""

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("init_communicator() first: wt-trl has no trainer engine yet")
        return self.engine


def _drawn(
    pairs: Iterable[tuple[str, torch.Tensor]], *, copy: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs`, each tensor copied as it is drawn when `copy` (one generator: running it
    to its end after a failure finishes the caller's iteration)."""
    for name, tensor in pairs:
        yield name, tensor.detach().clone() if copy else tensor


def _trainer() -> Any:
    """The TRL trainer whose call is on this thread's stack (it owns `state`)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        state = getattr(owner, "state", None)
        if isinstance(getattr(state, "global_step", None), int) and hasattr(owner, "args"):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def training_step() -> str | None:
    """The label of a sync: the global step of the TRL trainer syncing, as a string
    (None when no trainer is on the stack: a sync called directly)."""
    trainer = _trainer()
    return None if trainer is None else str(trainer.state.global_step)


def _copies_needed() -> bool:
    """Whether a drawn tensor dies when the next is drawn: DeepSpeed ZeRO-3 or FSDP1
    gather one parameter at a time and free it on the next."""
    with contextlib.suppress(ImportError):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return True
    trainer = _trainer()
    fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))
    return fsdp and not getattr(getattr(trainer, "accelerator", None), "is_fsdp2", False)
