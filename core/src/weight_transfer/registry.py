"""A lazy registry of backend classes: explicit registrations plus entry points.

One mechanism serves both factories. A backend is known by name from either

- `register(name, "module.path", "ClassName")` (imported on first use),
  `register(name, cls)`, or
- an installed distribution's entry point in the registry's group, named after
  the backend, with value `module:Class`.

Listing backends reads distribution metadata and imports nothing; resolving a
name imports that backend's module only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Generic, TypeVar

__all__ = ["BackendInfo", "BackendRegistry", "FIRST_PARTY_WHEELS"]

T = TypeVar("T")

# Backends this project ships, and the wheel that provides each.
FIRST_PARTY_WHEELS: dict[str, str] = {
    "nccl": "wt-nccl",
    "ipc": "wt-ipc",
    "sparse_nccl": "wt-sparse-nccl",
    "sharded_rdt": "wt-sharded-rdt",
}


@dataclass(frozen=True)
class BackendInfo:
    """Where a backend comes from; `distribution` is None for in-process registrations."""

    name: str
    target: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        origin = (
            f"{self.distribution} {self.version}" if self.distribution else "registered in-process"
        )
        return f"{self.name} ({origin})"


@dataclass(frozen=True)
class _Entry:
    info: BackendInfo
    load: Callable[[], type]


class BackendRegistry(Generic[T]):
    """Backends of one kind (`"trainer"` or `"engine"`), resolving to subclasses of `base`."""

    def __init__(self, kind: str, group: str, base: type[T]) -> None:
        self.kind = kind
        self.group = group
        self.base = base
        self._registered: dict[str, _Entry] = {}
        self._resolved: dict[str, type[T]] = {}

    # -- registration ------------------------------------------------------
    def register(
        self, name: str, module_path_or_cls: str | type[T], class_name: str | None = None
    ) -> None:
        """Register `name` lazily (module path + class name) or as a class.

        Raises `ValueError` if `name` is taken, by a registration or by an
        installed entry point, or if a module path comes without a class name.
        """
        taken = self._registered.get(name) or self._entry_points().get(name)
        if taken is not None:
            raise ValueError(
                f"weight transfer {self.kind} backend {name!r} is already registered "
                f"({taken.info.describe()})"
            )
        if isinstance(module_path_or_cls, str):
            if not class_name:
                raise ValueError("class_name is required when registering a module path")
            module_path = module_path_or_cls
            self._registered[name] = _Entry(
                BackendInfo(name, f"{module_path}:{class_name}"),
                lambda: getattr(importlib.import_module(module_path), class_name),
            )
        else:
            cls = module_path_or_cls
            target = f"{cls.__module__}:{cls.__qualname__}"
            self._registered[name] = _Entry(BackendInfo(name, target), lambda: cls)

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (entry points stay)."""
        self._registered.pop(name, None)
        self._resolved.pop(name, None)

    # -- discovery -----------------------------------------------------------
    def _entry_points(self) -> dict[str, _Entry]:
        found: dict[str, list[_Entry]] = {}
        for ep in metadata.entry_points(group=self.group):
            dist = ep.dist
            info = BackendInfo(
                ep.name,
                ep.value,
                dist.metadata["Name"] if dist is not None else None,
                dist.version if dist is not None else None,
            )
            found.setdefault(ep.name, []).append(_Entry(info, self._loader(ep, info)))
        result: dict[str, _Entry] = {}
        for name, entries in found.items():
            dists = {e.info.distribution for e in entries}
            if len(dists) > 1:
                result[name] = _Entry(entries[0].info, self._ambiguous(name, entries))
            else:
                result[name] = entries[0]
        return result

    def _loader(self, ep: metadata.EntryPoint, info: BackendInfo) -> Callable[[], type]:
        def load() -> type:
            try:
                loaded = ep.load()
            except Exception as e:
                raise ImportError(
                    f"weight transfer {self.kind} backend {info.name!r} from distribution "
                    f"{info.distribution} {info.version} (entry point {self.group}: "
                    f"{ep.name} = {ep.value}) failed to import: {type(e).__name__}: {e}"
                ) from e
            if not isinstance(loaded, type):
                raise TypeError(
                    f"entry point {self.group}: {ep.name} = {ep.value} "
                    f"({info.distribution}) is not a class"
                )
            return loaded

        return load

    def _ambiguous(self, name: str, entries: list[_Entry]) -> Callable[[], type]:
        def load() -> type:
            providers = ", ".join(sorted(str(e.info.distribution) for e in entries))
            raise ValueError(
                f"weight transfer {self.kind} backend {name!r} is advertised by several "
                f"distributions ({providers}); uninstall all but one"
            )

        return load

    def backends(self) -> dict[str, BackendInfo]:
        """Every known backend, sorted by name, without importing any of them."""
        entries = {**self._entry_points(), **self._registered}
        return {name: entries[name].info for name in sorted(entries)}

    # -- resolution ----------------------------------------------------------
    def resolve(self, name: str) -> type[T]:
        """The class for `name`, importing only its module.

        Raises `ValueError` for an unknown name (listing what is installed and,
        for first-party backends, the wheel to install), `ImportError` naming
        the distribution and entry point when the plugin fails to import, and
        `TypeError` when it is not a subclass of the registry's base class.
        """
        if name in self._resolved:
            return self._resolved[name]
        entry = self._registered.get(name) or self._entry_points().get(name)
        if entry is None:
            raise ValueError(self._unknown_message(name))
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(
                f"weight transfer {self.kind} backend {name!r} ({entry.info.target}, "
                f"{entry.info.describe()}) is not a subclass of {self.base.__qualname__}"
            )
        self._resolved[name] = cls
        return cls

    def _unknown_message(self, name: str) -> str:
        installed = self.backends()
        listing = ", ".join(i.describe() for i in installed.values()) or "none"
        msg = f"unknown weight transfer {self.kind} backend {name!r}. Installed: {listing}."
        wheel = FIRST_PARTY_WHEELS.get(name)
        if wheel is not None:
            msg += f" {name!r} is provided by the wheel {wheel}: pip install {wheel}"
        else:
            msg += (
                f" No installed distribution advertises {name!r} in the entry-point "
                f"group {self.group!r}; install the wheel that provides it."
            )
        return msg
