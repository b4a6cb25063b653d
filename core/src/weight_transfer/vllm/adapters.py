"""LoRA adapters in a vLLM worker, kept in memory: `AdapterLoader` and `lora_request`.

vLLM loads an adapter from `LoRARequest.lora_path` on disk the first time a
request names its `lora_int_id`, and again whenever its LRU cache evicted it.
wt keeps the adapters it synced in memory instead:

- `lora_request(name)` is the request of a wt adapter: its path is
  `wt-adapter:<name>` (`ADAPTER_SCHEME`), its id one of this process's own
  for that name (`adapter_int_id`). On the HTTP server the HTTP client
  registers that path under the adapter's name (`/v1/load_lora_adapter`),
  so the OpenAI `model` field names it.
- Each worker has one `AdapterStore` (per vLLM LoRA manager), made by the first
  adapter round: the committed adapters by name. It wraps the worker LoRA
  manager's `_load_adapter`, so a request under a synced name, or whose path
  has the scheme, is served from the store under the id the request carries;
  any other request loads from disk as before. It tells its engine core which
  adapters it serves (`weight_transfer.vllm.gate`), which fails a request on
  any other wt adapter alone instead of letting it fail inside a step.
- `AdapterLoader` is the round's transaction for an adapter round
  (`weight_transfer.runtime.adapters`). `begin` refuses a name of the served
  base model. `load` stages copies of the tensors (a transport may reuse its
  buffers); `commit` builds vLLM's `LoRAModel` and checks it against its
  config and the engine (`AdapterStore.check`) before it changes anything,
  then swaps it into the store and replaces vLLM's cached copies of the
  previous version, so the next step that runs the adapter activates the new
  one. vLLM runs a control call between steps, so a step sees one version of
  the adapter, whole. `abort` drops what was staged: the previous adapter and
  the model's weights are untouched. `commit(keep_undo=True)`, `revert` and
  `release` make it a `Revertible` for fleets.

Version-pinned to vLLM 0.32's LoRA manager, which 0.33.0 keeps
(`WorkerLoRAManager._load_adapter`, `LoRAModelManager.modules`,
`_create_merged_loras_inplace`, `get_adapter` / `add_adapter` / `remove_adapter`,
`model.lora_manager`; `tests/vllm/test_vllm_contract.py`).
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from weight_transfer.runtime.adapters import ADAPTER_FIELD, ADAPTER_SCHEME, Adapter

__all__ = ["ADAPTER_SCHEME", "AdapterLoader", "AdapterStore", "adapter_int_id", "lora_request"]


_ids: dict[str, int] = {}
_ids_lock = threading.Lock()
_FIRST_ID = 1 << 30  # above the ids vLLM's server counts from 1


def adapter_int_id(name: str) -> int:
    """The `lora_int_id` of the wt adapter `name` in this process: each name gets its
    own, the first time it is asked for (vLLM caches adapters by id, so two names
    under one id would serve each other's weights)."""
    with _ids_lock:
        found = _ids.get(name)
        if found is None:
            found = _ids[name] = _FIRST_ID + len(_ids)
        return found


def lora_request(name: str, int_id: int | None = None) -> Any:
    """vLLM's `LoRARequest` for the wt adapter `name` (for `LLM.generate(..., lora_request=)`)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(
        lora_name=name,
        lora_int_id=adapter_int_id(name) if int_id is None else int_id,
        lora_path=ADAPTER_SCHEME + name,
    )


@dataclass(frozen=True)
class _Version:
    """One committed version of an adapter: its tensors and vLLM's reading of its config."""

    tensors: dict[str, torch.Tensor]
    peft_helper: Any


class AdapterStore:
    """The adapters one worker serves from memory (see the module docstring).

    A name the trainer synced is served from here only: a request under that
    name loads this store's version whatever path it carries, so no caller
    that registers the name with a path of its own decides what it serves.
    A request whose path is `wt-adapter:<name>` under another name (an alias a
    caller registered) is served `<name>`'s version. `link` tells the engine
    core which adapters are served (`serving.Generation.adapter_served`), so
    that it fails a request on a removed one alone (`weight_transfer.vllm.gate`).
    """

    def __init__(self, manager: Any, worker_manager: Any, link: Any = None) -> None:
        self.manager = manager  # vLLM's LoRAModelManager (`model.lora_manager`)
        self.worker_manager = worker_manager
        self.link = link  # the engine core (`serving.Generation`), or None
        self.versions: dict[str, _Version] = {}
        self.serving: dict[int, str] = {}  # vLLM's adapter id -> the name it holds
        self._lock = threading.Lock()
        from_disk = worker_manager._load_adapter

        def load_adapter(request: Any) -> Any:
            name = self.served_name(request)
            if name is not None:
                return self.model_for(name, request.lora_int_id)
            model = from_disk(request)
            with self._lock:  # a sync of this name replaces what it loaded
                self.serving[request.lora_int_id] = request.lora_name
            return model

        worker_manager._load_adapter = load_adapter

    def served_name(self, request: Any) -> str | None:
        """The store's adapter that `request` runs on, or None (vLLM loads it from disk)."""
        name = getattr(request, "lora_name", None)
        if name in self.versions:
            return str(name)
        path = getattr(request, "lora_path", "")
        if isinstance(path, str) and path.startswith(ADAPTER_SCHEME):
            return path[len(ADAPTER_SCHEME) :]
        return None

    def model_for(self, name: str, lora_id: int) -> Any:
        """A `LoRAModel` of the committed adapter `name` under `lora_id`."""
        with self._lock:
            version = self.versions.get(name)
            if version is None:
                from vllm.exceptions import LoRAAdapterNotFoundError

                raise LoRAAdapterNotFoundError(name, ADAPTER_SCHEME + name)
            self.serving[lora_id] = name
        return self.build(version, lora_id)

    def build(self, version: _Version, lora_id: int) -> Any:
        from vllm.lora.lora_model import LoRAModel

        worker = self.worker_manager
        mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)
        copies = {name: t.clone() for name, t in version.tensors.items()}  # vLLM scales in place
        return LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=copies,
            peft_helper=version.peft_helper,
            device="cpu",
            dtype=worker.lora_config.lora_dtype,
            model_vocab_size=worker.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(self.manager.model, "lora_skip_prefixes", None),
        )

    def check(self, name: str, version: _Version) -> None:
        """Refuse a version this engine could not run as its config declares, naming
        the module and the field: the config's features and ranks against the
        engine's (`max_lora_rank`); every tensor a matrix of a module this model
        can adapt; every module both `lora_A` and `lora_B`, of the rank the config
        gives it (`r`, or its `rank_pattern` entry: the scaling vLLM applies is
        the config's only then), fitting the module's LoRA slots."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        helper = version.peft_helper
        try:
            helper.validate_legal(self.worker_manager.lora_config)
        except ValueError as error:
            raise ValueError(f"LoRA adapter {name!r}: {error}") from None
        expected = set()
        packed = self.manager.packed_modules_mapping
        for module in self.manager.supported_lora_modules:
            expected.update(packed.get(module, [module]))
        saved = set(helper.modules_to_save or ())
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in version.tensors.items():
            module_name, is_a = parse_fine_tuned_lora_name(tensor_name)
            if module_name.rsplit(".", 1)[-1] not in expected | saved:
                raise ValueError(
                    f"LoRA adapter {name!r}: parameter {tensor_name!r} targets a module this "
                    f"model cannot adapt (its LoRA modules: {sorted(expected)})"
                )
            if tensor.dim() != 2:
                raise ValueError(
                    f"LoRA adapter {name!r}: parameter {tensor_name!r} has shape "
                    f"{tuple(tensor.shape)}, not a matrix"
                )
            if module_name not in saved:
                parts.setdefault(module_name, {})["lora_A" if is_a else "lora_B"] = tensor
        for module_name, found in parts.items():
            _check_ranks(name, module_name, found, helper)
        lora = self.build(version, 1)
        self.manager._create_merged_loras_inplace(lora)
        for module_name, module in self.manager.modules.items():
            weights = lora.loras.get(module_name)
            if weights is not None and hasattr(module, "lora_a_stacked"):
                _check_slots(name, module_name, module, weights, packed)

    def install(self, name: str, version: _Version | None) -> _Version | None:
        """Serve `version` as `name` (None: remove it); returns the one it replaces.
        Every id vLLM holds `name`'s weights under (loaded through this store, or
        from disk under the name before its first sync) is replaced in vLLM's
        cache too (removed, for a removal), so the next step activates this one;
        the engine core is told whether `name` is served."""
        with self._lock:
            previous = self.versions.pop(name, None)
            if version is not None:
                self.versions[name] = version
            held = {i for i, n in self.serving.items() if n == name}
            if version is None:
                for lora_id in held:
                    del self.serving[lora_id]
        for lora_id in held:
            cached = self.manager.get_adapter(lora_id) is not None
            self.manager.remove_adapter(lora_id)
            if version is not None and cached:  # an evicted id reloads through the hook
                self.manager.add_adapter(self.build(version, lora_id))
        if self.link is not None and (previous is None) != (version is None):
            self.link.adapter_served(name, version is not None)
        return previous


def _check_ranks(name: str, module: str, found: dict[str, torch.Tensor], helper: Any) -> None:
    """`module`'s `lora_A` and `lora_B` are both there and of the rank its config gives."""
    missing = [part for part in ("lora_A", "lora_B") if part not in found]
    if missing:
        raise ValueError(
            f"LoRA adapter {name!r}: module {module!r} has no {missing[0]} (each adapted "
            "module needs both lora_A and lora_B)"
        )
    rank, _ = helper.get_rank_and_scaling(module)
    a_rank, b_rank = found["lora_A"].shape[0], found["lora_B"].shape[1]
    if a_rank != rank or b_rank != rank:
        field = "config.rank_pattern" if rank != helper.r else "config.r"
        raise ValueError(
            f"LoRA adapter {name!r}: module {module!r} has lora_A of rank {a_rank} and "
            f"lora_B of rank {b_rank}, but field {field!r} gives it rank {rank} (vLLM "
            "would scale it by its config's rank and run a slot of that rank)"
        )


def _check_slots(
    name: str, module_name: str, module: Any, weights: Any, packed: dict[str, list[str]]
) -> None:
    """`weights` fit `module`'s LoRA slots exactly (vLLM's `set_lora` would copy a
    smaller tensor into part of a slot without a word). The error names the
    adapter's module (`q_proj`), not only vLLM's packed one (`qkv_proj`)."""
    lora_a, lora_b = weights.lora_a, weights.lora_b
    if getattr(module, "tp_size", 1) > 1:
        lora_a, lora_b = module.slice_lora_a(lora_a), module.slice_lora_b(lora_b)
    a_list = lora_a if isinstance(lora_a, list) else [lora_a]
    b_list = lora_b if isinstance(lora_b, list) else [lora_b]
    prefix, _, last = module_name.rpartition(".")
    for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        if a is None or b is None:
            continue
        slot_a, slot_b = module.lora_a_stacked[i], module.lora_b_stacked[i]
        rank, fan_in, fan_out = a.shape[0], slot_a.shape[-1], slot_b.shape[-2]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            parts = packed.get(last)
            adapted = f"{prefix}.{parts[i]}" if parts and i < len(parts) else module_name
            raise ValueError(
                f"LoRA adapter {name!r}: module {adapted!r} (vLLM's {module_name!r}) takes "
                f"lora_A of shape (r, {fan_in}) and lora_B of shape ({fan_out}, r), got "
                f"{tuple(a.shape)} and {tuple(b.shape)}"
            )


def _served_model_names(vllm_config: Any) -> set[str]:
    """The names requests reach the base model by (`served_model_name`, the model path)."""
    config = getattr(vllm_config, "model_config", None)
    names = getattr(config, "served_model_name", None)
    listed = [names] if isinstance(names, str) else list(names or ())
    return {str(n) for n in [*listed, getattr(config, "model", None)] if n}


_stores: weakref.WeakKeyDictionary[Any, AdapterStore] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()


def store_for(model: torch.nn.Module) -> AdapterStore:
    """The worker's adapter store (made on first use); `RuntimeError` without LoRA."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError(
            "this vLLM engine serves no LoRA adapters: start it with enable_lora=True "
            "(--enable-lora) and a max_lora_rank at least the adapter's rank"
        )
    with _stores_lock:
        store = _stores.get(manager)
        if store is None:
            from weight_transfer.vllm.serving import Generation

            link = Generation.of_caller(data_parallel=True)
            store = _stores[manager] = AdapterStore(manager, _worker_manager_of(manager), link)
        return store


def _worker_manager_of(manager: Any) -> Any:
    """The `WorkerLoRAManager` that drives `manager`. vLLM keeps no link back to it,
    so it is read off the worker whose control call is running (on the stack: a
    worker's `model_runner.lora_manager`)."""
    frame = sys._getframe(1)
    while frame is not None:
        holder = frame.f_locals.get("self")
        for owner in (holder, getattr(holder, "model_runner", None)):
            candidate = getattr(owner, "lora_manager", None)
            if getattr(candidate, "_adapter_manager", None) is manager:
                return candidate
        frame = frame.f_back  # type: ignore[assignment]
    raise RuntimeError(
        "the vLLM worker driving this model's LoRA adapters was not found on the stack "
        "(an adapter round starts from the worker's update_weights call)"
    )


class AdapterLoader:
    """The transaction of a round that updates (or removes) one adapter; see the module doc."""

    exact_undo = True

    def __init__(self, model: torch.nn.Module, vllm_config: Any, adapter: Adapter) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.adapter = adapter
        self.staged: dict[str, torch.Tensor] = {}
        self.store: AdapterStore | None = None
        self._undo: tuple[_Version | None] | None = None
        self._ended = False
        self._lock = threading.Lock()  # a transport's load thread against the control thread

    def begin(self) -> None:
        served = _served_model_names(self.vllm_config)
        if self.adapter.name in served:
            raise ValueError(
                f"{ADAPTER_FIELD}: field 'name' ({self.adapter.name!r}) is a name of the "
                f"served base model ({sorted(served)}): requests on it would get the base model"
            )
        self.store = store_for(self.model)
        if self.adapter.remove and self.adapter.name not in self.store.versions:
            raise ValueError(f"no LoRA adapter {self.adapter.name!r} to remove")

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            self._stage(weights)

    def _stage(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self._ended:
            raise RuntimeError(f"adapter {self.adapter.name!r}: load after the round ended")
        if self.adapter.remove:
            raise ValueError(f"adapter {self.adapter.name!r}: a removal round loads nothing")
        for name, tensor in weights:
            if ".lora_" not in name:
                raise ValueError(
                    f"adapter {self.adapter.name!r}: parameter {name!r} is not a LoRA tensor"
                )
            if name in self.staged:
                raise ValueError(f"adapter {self.adapter.name!r}: parameter {name!r} sent twice")
            self.staged[name] = tensor.detach().to("cpu", copy=True)

    def commit(self, keep_undo: bool = False) -> None:
        if self._ended:
            return
        store = self.store
        assert store is not None, "commit before begin"
        version = None
        if not self.adapter.remove:
            if not self.staged:
                raise ValueError(f"adapter {self.adapter.name!r}: the round sent no tensors")
            from vllm.lora.peft_helper import PEFTHelper

            config = dict(self.adapter.config)
            config["vllm_max_position_embeddings"] = store.worker_manager.max_position_embeddings
            try:
                helper = PEFTHelper.from_dict(config)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"wt_adapter: field 'config' is not a LoRA config: {error}"
                ) from None
            version = _Version(self.staged, helper)
            store.check(self.adapter.name, version)
        previous = store.install(self.adapter.name, version)
        self._ended = True
        self.staged = {}
        self._undo = (previous,) if keep_undo else None

    def abort(self) -> None:
        with self._lock:
            self._ended = True
            self.staged = {}

    def revert(self) -> None:
        if self._undo is None or self.store is None:
            raise RuntimeError(f"adapter {self.adapter.name!r}: no committed round is held")
        (previous,), self._undo = self._undo, None
        self.store.install(self.adapter.name, previous)

    def release(self) -> None:
        self._undo = None
