"""What makes GPU code slow, counted on CPU: host syncs and aten ops.

`HostSyncs` counts, process-wide and on every thread, the `Tensor` methods
that read a device value back to the host (`item`, `tolist`, `bool`, `int`,
`float`, `index`): on a GPU each one stops the host until the device drains.
`Collectives` counts the collectives a process calls (process-wide).
`AtenOps` counts the aten ops dispatched on the thread that enters it (a
`TorchDispatchMode`), by name, including the host reads it sees
(`aten._local_scalar_dense`, `aten.is_nonzero`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

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


class AtenOps(TorchDispatchMode):
    """`counts`: the aten ops (by overload name) this thread dispatched while inside."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


_COLLECTIVE_MODULES = (
    "torch.distributed.distributed_c10d",
    "torch.distributed._functional_collectives",
)
_COLLECTIVE_WORDS = ("gather", "reduce", "broadcast", "all_to_all", "scatter", "barrier")


class Collectives:
    """A context manager: `counts` holds, per function, the collectives called in this
    process (every thread) while inside: the public functions of `torch.distributed`
    and of its functional collectives (what `DTensor.full_tensor` runs) whose names
    say gather, reduce, broadcast, all-to-all, scatter or barrier."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def gathers(self) -> int:
        return sum(n for name, n in self.counts.items() if "gather" in name)

    def _counting(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return function(*args, **kwargs)

        return counted

    def __enter__(self) -> Collectives:
        import importlib

        for module_name in _COLLECTIVE_MODULES:
            module = importlib.import_module(module_name)
            for name, function in list(vars(module).items()):
                if name.startswith("_") or not callable(function) or isinstance(function, type):
                    continue
                if any(word in name for word in _COLLECTIVE_WORDS):
                    self._saved.append((module, name, function))
                    setattr(module, name, self._counting(f"{module_name}.{name}", function))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, function in reversed(self._saved):
            setattr(module, name, function)
        self._saved = []
