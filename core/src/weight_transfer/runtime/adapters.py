"""LoRA adapter rounds: a round that updates one named adapter, not the model.

Trainer side: a source whose `adapter` attribute is an `Adapter` (`LoRASource`:
the LoRA tensors of a PEFT model) makes every round an adapter round.
`RoundClient` sends `{ADAPTER_FIELD: adapter.to_payload()}` right after the
start, before anything loads, and after a successful finish tells a client
that registers adapter names with its server (`adapter_landed`: the HTTP
client) that the adapter is there. `remove_adapter` runs a round that removes
one.

Worker side (`weight_transfer.runtime.worker_round`): the control retargets
the open round at the host's adapter loader (`Host.adapter_loader`; in vLLM
`weight_transfer.vllm.adapters.AdapterLoader`). It stages what the
backend loads and swaps the adapter in at commit, so requests on the adapter
see the old adapter or the new one; a failed round keeps the old one, and the
model's own weights are never touched. The tensors travel through the
backend's ordinary `receive_weights` and `loader.load`, under the names PEFT
saves them with (`base_model.model.<module>.lora_A.weight`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from weight_transfer.source import ParamMeta, WeightSource

__all__ = [
    "ADAPTER_FIELD",
    "ADAPTER_SCHEME",
    "Adapter",
    "LoRASource",
    "adapter_of",
    "remove_adapter",
]

# `{ADAPTER_FIELD: Adapter.to_payload()}`: this round updates (or removes) that adapter.
ADAPTER_FIELD = "wt_adapter"
# The `lora_path` of a wt adapter in vLLM's requests: `wt-adapter:<name>` (served from memory).
ADAPTER_SCHEME = "wt-adapter:"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Adapter:
    """A round's adapter: its `name` (what requests name), its PEFT `config`
    (`r`, `lora_alpha`, `target_modules`, ... as `LoraConfig.to_dict()` gives
    them, made plain JSON), and whether the round `remove`s it."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    remove: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"{ADAPTER_FIELD}: field 'name' must be 1-128 letters, digits, '.', '_' or '-' "
                f"(not starting with a punctuation mark), got {self.name!r}"
            )
        if not isinstance(self.config, dict):
            raise ValueError(f"{ADAPTER_FIELD}: field 'config' must be a dict")
        if not self.remove:
            for key, kind in (("r", int), ("lora_alpha", (int, float)), ("target_modules", None)):
                value = self.config.get(key)
                if value is None or (kind is not None and not isinstance(value, kind)):
                    raise ValueError(
                        f"{ADAPTER_FIELD}: field 'config.{key}' is missing or malformed "
                        f"({value!r}) for adapter {self.name!r}"
                    )

    def to_payload(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "remove": self.remove}

    @classmethod
    def from_payload(cls, payload: Any) -> Adapter:
        """The adapter a control carries; `ValueError` naming the bad field."""
        if not isinstance(payload, dict):
            raise ValueError(f"update_info: field {ADAPTER_FIELD!r} must be a dict")
        unknown = sorted(set(payload) - {"name", "config", "remove"})
        if unknown:
            raise ValueError(f"{ADAPTER_FIELD}: unknown field(s) {unknown}")
        if not isinstance(payload.get("remove", False), bool):
            raise ValueError(f"{ADAPTER_FIELD}: field 'remove' must be a bool")
        return cls(payload.get("name"), payload.get("config", {}), payload.get("remove", False))  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    """`value` as plain JSON: sets become sorted lists, enums their values."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class LoRASource(WeightSource):
    """The LoRA tensors of one adapter of a PEFT model, and the adapter's config.

    `model` is a `peft.PeftModel` (or any module holding PEFT LoRA layers and a
    `peft_config` dict); `adapter_name` is the adapter inside it, `name` the one
    requests use on the inference side (default: `adapter_name`). Tensors are
    yielded under the names PEFT saves them with (the adapter's name taken out
    of the parameter name), as they are now: build the source once and send
    after every optimizer step. Only the adapter travels; the base model's
    weights are not read.
    """

    def __init__(
        self, model: torch.nn.Module, adapter_name: str = "default", *, name: str | None = None
    ) -> None:
        if not isinstance(getattr(model, "peft_config", None), dict):
            raise ValueError("LoRASource: the model is not a PEFT model (it has no peft_config)")
        self.module = model
        self.select(adapter_name, name=name)

    def select(self, adapter_name: str, *, name: str | None = None) -> None:
        """Send the model's adapter `adapter_name` from the next round on, as `name`
        (default: `adapter_name`): one trainer keeps several adapters in sync."""
        configs = cast("dict[str, Any]", self.module.peft_config)
        if adapter_name not in configs:
            raise ValueError(
                f"LoRASource: the model has no PEFT adapter {adapter_name!r} "
                f"(its adapters: {sorted(configs)})"
            )
        config = _plain(configs[adapter_name].to_dict())
        if config.get("peft_type") not in (None, "LORA"):
            raise ValueError(
                f"LoRASource: adapter {adapter_name!r} is {config['peft_type']}, not LoRA"
            )
        lora_segment = re.compile(rf"\.(lora_[A-Za-z_]+)\.{re.escape(adapter_name)}(?=\.|$)")
        names: list[tuple[str, str]] = []  # (saved name, parameter name)
        for param_name, _ in self.module.named_parameters():
            saved, found = lora_segment.subn(r".\1", param_name)
            if found:
                names.append((saved, param_name))
        if not names:
            raise ValueError(f"LoRASource: adapter {adapter_name!r} has no LoRA parameters")
        self.adapter_name = adapter_name
        self.adapter = Adapter(name or adapter_name, config)
        self._names = names

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.module.named_parameters())
        for saved, param_name in self._names:
            yield saved, params[param_name].detach()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._tensors()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return self._tensors()

    @property
    def nbytes(self) -> int:
        """The bytes one sync moves: the adapter's tensors."""
        return sum(t.numel() * t.element_size() for _, t in self._tensors())


def adapter_of(source: Any) -> Adapter | None:
    """The adapter `source` updates (its `adapter` attribute), or None for model weights."""
    adapter = getattr(source, "adapter", None)
    if adapter is not None and not isinstance(adapter, Adapter):
        raise TypeError(f"{type(source).__name__}.adapter must be a weight_transfer Adapter")
    return adapter


def remove_adapter(engine: Any, name: str) -> None:
    """Remove the adapter `name` from every worker the trainer `engine` serves, in
    a round of its own (on the sending rank; other ranks return).

    The HTTP server's name is unregistered first, so new requests naming it are
    refused there (404), and the HTTP client pauses in `"wait"` mode for the
    round, so requests in flight on it finish first. An in-process engine runs
    no request during the caller's call. A request that names a removed
    adapter afterwards fails in vLLM as one naming a deleted adapter directory
    does: remove an adapter once no caller of the engine uses it."""
    if not getattr(engine, "is_sender", True):
        return
    engine.client.adapter_round(Adapter(name, remove=True))
