"""The two factories: trainer engines and worker engines, each over its own registry.

They share backend names by convention only; a trainer process never creates a
worker engine and vice versa, so neither imports the other's modules.
Entry-point groups: `weight_transfer.trainer` and `weight_transfer.engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from weight_transfer.registry import BackendInfo, BackendRegistry

if TYPE_CHECKING:
    from weight_transfer.runtime.worker_round import GuardedEngine

__all__ = ["WeightTransferTrainerFactory", "WeightTransferEngineFactory", "list_backends"]

TRAINER_GROUP = "weight_transfer.trainer"
ENGINE_GROUP = "weight_transfer.engine"


class WeightTransferTrainerFactory:
    """Creates trainer engines; the backend comes from the init info's `backend` ClassVar."""

    registry: BackendRegistry[TrainerWeightTransferEngine[Any]] = BackendRegistry(
        "trainer",
        TRAINER_GROUP,
        TrainerWeightTransferEngine,  # type: ignore[type-abstract]
    )

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[TrainerWeightTransferEngine[Any]],
        class_name: str | None = None,
    ) -> None:
        cls.registry.register(name, module_path_or_cls, class_name)

    @classmethod
    def available_backends(cls) -> dict[str, BackendInfo]:
        return cls.registry.backends()

    @classmethod
    def get_engine_class(cls, backend: str) -> type[TrainerWeightTransferEngine[Any]]:
        return cls.registry.resolve(backend)

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine[Any]:
        """Resolve `init_info.backend` and run that engine's `trainer_init`."""
        engine_cls = cls.get_engine_class(init_info.backend)
        expected = getattr(engine_cls, "init_info_cls", None)
        if expected is not None and not isinstance(init_info, expected):
            raise TypeError(
                f"backend {init_info.backend!r} expects {expected.__name__}, "
                f"got {type(init_info).__name__}"
            )
        return engine_cls.trainer_init(init_info, client=client, source=source)


class WeightTransferEngineFactory:
    """Creates worker engines; the backend comes from `config.backend`."""

    registry: BackendRegistry[WeightTransferEngine[Any, Any]] = BackendRegistry(
        "engine",
        ENGINE_GROUP,
        WeightTransferEngine,  # type: ignore[type-abstract]
    )

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[WeightTransferEngine[Any, Any]],
        class_name: str | None = None,
    ) -> None:
        cls.registry.register(name, module_path_or_cls, class_name)

    @classmethod
    def available_backends(cls) -> dict[str, BackendInfo]:
        return cls.registry.backends()

    @classmethod
    def get_engine_class(cls, backend: str) -> type[WeightTransferEngine[Any, Any]]:
        return cls.registry.resolve(backend)

    @classmethod
    def create_engine(
        cls,
        config: Any,
        vllm_config: Any,
        device: torch.device | str,
        model: torch.nn.Module,
    ) -> GuardedEngine:
        """Create the engine named by `config.backend` for `model` on `device`, inside
        wt-core's round (`.backend` is the backend's own engine).

        `vllm_config` is a `VllmConfig` inside vLLM; elsewhere a
        `WorkerPosition` or `None` (the only worker).
        """
        backend = getattr(config, "backend", None)
        if not isinstance(backend, str):
            raise ValueError("config.backend must name a weight transfer backend")
        from weight_transfer.runtime.worker_round import guarded

        return guarded(cls.get_engine_class(backend)(config, vllm_config, device, model))

    @classmethod
    def hosted_engine_class(cls, backend: str) -> type[GuardedEngine]:
        """The class a host instantiates for `backend`: the backend's engine inside
        wt-core's round (`GuardedEngine.hosting`), with the backend's constructor."""
        from weight_transfer.runtime.worker_round import GuardedEngine

        return GuardedEngine.hosting(cls.get_engine_class(backend))


def list_backends() -> dict[str, dict[str, BackendInfo]]:
    """Installed backends of both kinds, with the distribution and version of each."""
    return {
        "trainer": WeightTransferTrainerFactory.available_backends(),
        "engine": WeightTransferEngineFactory.available_backends(),
    }
