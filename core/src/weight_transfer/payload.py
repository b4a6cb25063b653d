"""Typed parsing of the JSON-safe dicts that cross the control plane.

`parse_payload(cls, data, what)` builds dataclass `cls` from `data` and raises
`ValueError` naming the field when a key is unknown, a required key is missing
or a value has the wrong type. Supported field types: `int`, `float`, `str`,
`bool`, `None`, `Any`, unions of these, `list[T]`, `tuple[T, ...]` (accepting
lists) and `dict[str, T]`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["parse_payload", "payload_of"]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:  # `Optional[int]`, not just `Optional`
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, path: str) -> None:
    """Raise ValueError naming `path` unless `value` fits type `tp`."""
    if tp is Any or tp is object:
        return
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                _check(value, option, path)
                return
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"field {path!r}: expected {_type_name(tp)}, got {value!r:.80}")
    if tp is type(None):
        if value is not None:
            raise ValueError(f"field {path!r}: expected None, got {value!r:.80}")
        return
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"field {path!r}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        for i, item in enumerate(value):
            _check(item, item_tp, f"{path}[{i}]")
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"field {path!r}: expected an object, got {type(value).__name__}")
        args = typing.get_args(tp)
        val_tp = args[1] if len(args) == 2 else Any
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"field {path!r}: keys must be strings, got {k!r:.80}")
            _check(v, val_tp, f"{path}[{k!r}]")
        return
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:  # an annotation this parser does not know: accept, the engine validates
        ok = True
    if not ok:
        raise ValueError(
            f"field {path!r}: expected {_type_name(tp)}, got {type(value).__name__} {value!r:.80}"
        )


def parse_payload(cls: type[T], data: Any, what: str) -> T:
    """Build dataclass `cls` from dict `data`; `what` names the payload in errors."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{what}: unknown field {unknown[0]!r} for {cls.__name__} "
            f"(accepted fields: {', '.join(sorted(fields))})"
        )
    hints = typing.get_type_hints(cls)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                raise ValueError(f"{what}: missing required field {name!r} for {cls.__name__}")
            continue
        try:
            _check(data[name], hints.get(name, Any), name)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return cls(**data)


def payload_of(info: Any) -> dict[str, Any]:
    """The JSON-safe dict of dataclass `info`: its init fields, those that are `None` left out
    (fields with `init=False` are derived on the receiving side)."""
    wire = {f.name for f in dataclasses.fields(info) if f.init}
    return {k: v for k, v in dataclasses.asdict(info).items() if v is not None and k in wire}
