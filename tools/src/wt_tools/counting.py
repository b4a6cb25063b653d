"""What makes GPU code slow, counted on CPU: host syncs and aten ops.

`HostSyncs` counts, process-wide and on every thread, the `Tensor` methods
that read a device value back to the host (`item`, `tolist`, `bool`, `int`,
`float`, `index`): on a GPU each one stops the host until the device drains.
`Collectives` counts the collectives a process calls (process-wide).
`AtenOps` counts the aten ops dispatched on the thread that enters it (a
`TorchDispatchMode`), by name, including the host reads it sees
(`aten._local_scalar_dense`, `aten.is_nonzero`), the bytes its copies write
and the tensors its ops allocate. `WireCalls` counts the messages a process
puts on a wt wire: group broadcasts and local-link frames. `ProducerCalls`
counts the calls between wt_sharded_rdt's consumers and producers (Ray actor
calls on its nixl carrier). `CountedClient` counts the control-plane calls a
trainer makes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class HostSyncs:
    """A context manager: `counts` holds, per method, the calls made while inside."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _counting(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def start(self) -> HostSyncs:
        for name in HOST_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        return self

    def stop(self) -> HostSyncs:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)  # inherited from the C base again
            else:
                setattr(torch.Tensor, name, saved)
        self._saved.clear()
        return self

    def __enter__(self) -> HostSyncs:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_COPIES = ("aten.copy_.default", "aten._foreach_copy_.default")


class AtenOps(TorchDispatchMode):
    """`counts`: the aten ops (by overload name) this thread dispatched while inside;
    `copied_bytes`: the bytes written by copies into existing tensors (`copy_`,
    `_foreach_copy_`) and by ops that return a copy (`clone`, `_to_copy`, ...);
    `allocations`: per op, the storages its results hold that none of its inputs
    holds (the outputs of one op that share a storage count once)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.copied_bytes = 0
        self.allocations: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.counts[name] += 1
        out = func(*args, **(kwargs or {}))
        if name in _COPIES:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.copied_bytes += sum(t.nbytes for t in targets)
            return out
        inputs = {_storage(t) for t in _tensors(args, kwargs)}
        fresh = {
            _storage(made): made
            for made in _tensors((out,), None)
            if made.untyped_storage().nbytes() and _storage(made) not in inputs
        }
        if fresh:
            self.allocations[name] += len(fresh)
            if name in ("aten.clone.default", "aten._to_copy.default"):
                self.copied_bytes += sum(t.nbytes for t in fresh.values())
        return out


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in [*args, *(kwargs or {}).values()]:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


_P = TypeVar("_P", bound="_Patching")


class _Patching:
    """Counts, process-wide and on every thread, calls of the functions `start` patches
    (`_patch`), by label, until `stop` puts the originals back; a context manager."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def start(self) -> _Patching:
        raise NotImplementedError

    def _patch(self, owner: Any, attr: str, label: str) -> None:
        function = vars(owner)[attr]
        self._saved.append((owner, attr, function))

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[label] += 1
            return function(*args, **kwargs)

        setattr(owner, attr, counted)

    def stop(self) -> _Patching:
        for owner, attr, function in reversed(self._saved):
            setattr(owner, attr, function)
        self._saved = []
        return self

    def __enter__(self: _P) -> _P:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class WireCalls(_Patching):
    """The messages this process puts on (or takes off) a wt wire while inside: each
    broadcast of a `StatelessGroup` (a collective, either side) and each frame a
    `LocalLink` sends (ipc's control frames)."""

    def start(self) -> WireCalls:
        from wt_kits.colocated.link import LocalLink
        from wt_kits.group.stateless import StatelessGroup

        self._patch(StatelessGroup, "broadcast", "StatelessGroup.broadcast")
        self._patch(LocalLink, "send", "LocalLink.send")
        return self


class ProducerCalls(_Patching):
    """The calls between wt_sharded_rdt's consumers and producers while inside, by
    method: each call of the loopback carrier (`wt_sharded_rdt.transport`) is one Ray
    actor call on the nixl carrier, which has the same methods, but `stage` (local:
    it copies into shared staging, and `publish` carries what it staged)."""

    def start(self) -> ProducerCalls:
        from wt_sharded_rdt.transport import LoopbackClient, LoopbackHost

        for owner in (LoopbackHost, LoopbackClient):
            for name, function in list(vars(owner).items()):
                if not name.startswith("_") and callable(function):
                    self._patch(owner, name, f"{owner.__name__}.{name}")
        return self


class CountedClient:
    """Forwards to `inner`, counting the calls of its public methods by name (`counts`):
    the control-plane round trips a trainer makes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name.startswith("_") or not callable(value):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return value(*args, **kwargs)

        return counted


_COLLECTIVE_MODULES = (
    "torch.distributed.distributed_c10d",
    "torch.distributed._functional_collectives",
)
_COLLECTIVE_WORDS = ("gather", "reduce", "broadcast", "all_to_all", "scatter", "barrier")


class Collectives(_Patching):
    """A context manager: `counts` holds, per function, the collectives called in this
    process (every thread) while inside: the public functions of `torch.distributed`
    and of its functional collectives (what `DTensor.full_tensor` runs) whose names
    say gather, reduce, broadcast, all-to-all, scatter or barrier."""

    @property
    def gathers(self) -> int:
        return sum(n for name, n in self.counts.items() if "gather" in name)

    def start(self) -> Collectives:
        import importlib

        for module_name in _COLLECTIVE_MODULES:
            module = importlib.import_module(module_name)
            for name, function in list(vars(module).items()):
                if name.startswith("_") or not callable(function) or isinstance(function, type):
                    continue
                if any(word in name for word in _COLLECTIVE_WORDS):
                    self._patch(module, name, f"{module_name}.{name}")
        return self
