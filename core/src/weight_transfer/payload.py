"""The payloads that cross the control plane: JSON-safe dicts, dtype names, the wire version.

- `parse_payload(cls, data, what)` builds dataclass `cls` from `data` and raises
  `ValueError` naming the field when a key is unknown, a required key is
  missing or a value has the wrong type (field types: `int`, `float`, `str`,
  `bool`, `None`, `Any`, unions of these, `list[T]`, `tuple[T, ...]`
  accepting lists, and `dict[str, T]`); `payload_of(info)` is the reverse.
- The dtype codec: a wire name is the dtype's attribute name in torch
  (`"bfloat16"`), decoded through an allowlist (`WIRE_DTYPES`), never by
  looking a name up on the `torch` module.
- The wire protocol: a backend whose two sides depend on core's bucket layout
  or dtype codec mixes `WireProtocolInfo` into its worker init info; its
  trainer then ships `wire_protocol` in the handshake and the worker refuses
  a different version before parsing anything else
  (`check_wire_protocol`). A backend that does not declare it parses its init
  info as it is; a `wire_protocol` that arrives anyway is still checked, then
  dropped. Bump `WIRE_PROTOCOL_VERSION` whenever a change in core alters what
  crosses the wire (layout rules, codec, handshake fields).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")

__all__ = [
    "parse_payload",
    "payload_of",
    "WIRE_DTYPES",
    "dtype_name",
    "dtype_from_name",
    "WIRE_PROTOCOL_VERSION",
    "WireProtocolInfo",
    "ProtocolMismatchError",
    "check_wire_protocol",
]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:  # `Optional[int]`, not just `Optional`
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


Check = Callable[[Any, str], None]

# Exact types a JSON value of each primitive annotation may have (`True` is no `int`).
_EXACT: dict[Any, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
    type(None): (type(None),),
}


def _check(value: Any, tp: Any, path: str) -> None:
    """Raise ValueError naming `path` unless `value` fits type `tp`."""
    _checker(tp)(value, path)


def _checker(tp: Any) -> Check:
    """The check for annotation `tp`, built once per annotation.

    A list of a primitive type is checked in one pass over its items (an
    update info carries tens of thousands); only a list that fails is walked
    again to name the first bad index.
    """
    return _build(tp, repr(tp))  # `int | None == Optional[int]`: errors spell it as written


@functools.cache
def _build(tp: Any, spelled: str) -> Check:
    if tp is Any or tp is object:
        return _accept
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(tp)
    if tp in _EXACT:
        return _primitive_checker(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return _list_checker(args[0] if args else Any)
    if origin is dict:
        args = typing.get_args(tp)
        return _dict_checker(args[1] if len(args) == 2 else Any)
    if isinstance(tp, type):
        return _primitive_checker(tp)
    return _accept  # an annotation this parser does not know: accept, the engine validates


def _accept(value: Any, path: str) -> None:
    return None


def _primitive_checker(tp: type) -> Check:
    exact = _EXACT.get(tp)
    expected = "None" if tp is type(None) else _type_name(tp)

    def check(value: Any, path: str) -> None:
        ok = type(value) in exact if exact is not None else isinstance(value, tp)
        if not ok:
            got = "" if tp is type(None) else f"{type(value).__name__} "
            raise ValueError(f"field {path!r}: expected {expected}, got {got}{value!r:.80}")

    return check


def _union_checker(tp: Any) -> Check:
    options = [_checker(option) for option in typing.get_args(tp)]

    def check(value: Any, path: str) -> None:
        for option in options:
            try:
                option(value, path)
                return
            except ValueError:
                continue
        raise ValueError(f"field {path!r}: expected {_type_name(tp)}, got {value!r:.80}")

    return check


def _list_checker(item_tp: Any) -> Check:
    item = _checker(item_tp)
    exact = _EXACT.get(item_tp)
    inner = typing.get_origin(item_tp) in (list, tuple) and typing.get_args(item_tp)[:1]
    inner_exact = _EXACT.get(typing.get_args(item_tp)[0]) if inner else None

    def fits(value: Any) -> bool:
        """The one-pass test of the common cases; False means "walk to find out"."""
        if exact is not None:
            return all(type(v) in exact for v in value)
        if inner_exact is not None:  # a list of lists of a primitive (shapes)
            return all(
                type(v) in (list, tuple) and all(type(x) in inner_exact for x in v) for v in value
            )
        return item is _accept

    def check(value: Any, path: str) -> None:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"field {path!r}: expected a list, got {type(value).__name__}")
        if fits(value):
            return
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]")

    return check


def _dict_checker(val_tp: Any) -> Check:
    val = _checker(val_tp)

    def check(value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"field {path!r}: expected an object, got {type(value).__name__}")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"field {path!r}: keys must be strings, got {k!r:.80}")
            val(v, f"{path}[{k!r}]")

    return check


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
    hints = _hints(cls)
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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def payload_of(info: Any) -> dict[str, Any]:
    """The JSON-safe dict of dataclass `info`: its init fields, those that are `None` left out
    (fields with `init=False` are derived on the receiving side)."""
    wire = {f.name for f in dataclasses.fields(info) if f.init}
    return {k: v for k, v in dataclasses.asdict(info).items() if v is not None and k in wire}


# -- dtypes ----------------------------------------------------------------------

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`; `ValueError` if it cannot travel."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot travel; allowed: {', '.join(WIRE_DTYPES)}"
        ) from None


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The dtype for wire name `name`; `ValueError` naming `field` if unknown."""
    try:
        return WIRE_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"field {field!r}: unknown dtype {name!r}; allowed: {', '.join(WIRE_DTYPES)}"
        ) from None


# -- the wire protocol -------------------------------------------------------------

# 2: the authenticated store (`secret`), `verify`. 3: every store frame authenticated, the
# two-lane digest, the nccl header (int64[8]) and sparse header (int64[34]), ipc seals and
# LAYOUT frames, the trainer's control key in every init payload. 4: the nccl round header
# and per-bucket status tail, the digest over 64-byte block sums.
WIRE_PROTOCOL_VERSION = 4


@dataclass
class WireProtocolInfo:
    """Mixed into a worker init info: "this backend uses core's layout and codec"."""

    wire_protocol: int = field(default=WIRE_PROTOCOL_VERSION, kw_only=True)


class ProtocolMismatchError(ValueError):
    """The trainer and the worker speak different wire protocols."""


def _wheel_hint() -> str:
    try:
        version = importlib.metadata.version("wt-core")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed as a distribution)"
    return (
        f"this worker has wt-core {version}; install the same wt-core version "
        "(and matching backend wheels) in the trainer and the inference environment"
    )


def check_wire_protocol(
    payload: dict[str, Any], *, required: bool = True, what: str = "init_info"
) -> dict[str, Any]:
    """`payload` without a foreign `wire_protocol`, after checking it.

    Raises `ProtocolMismatchError` naming both versions when `payload` carries
    a different version, or when it carries none and `required` (the init info
    declares `WireProtocolInfo`). With `required=False` the field is removed,
    so an init info that does not declare it parses unchanged.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"{what}: expected an object, got {type(payload).__name__}")
    got = payload.get("wire_protocol")
    if got is None and required:
        raise ProtocolMismatchError(
            f"{what}: missing field 'wire_protocol'. This backend's worker uses wt-core's "
            f"shared layout and codec (wire protocol {WIRE_PROTOCOL_VERSION}), so its trainer "
            f"must send the version it speaks; the trainer's wt-core predates wire protocols "
            f"or the trainer was written without them ({_wheel_hint()})"
        )
    if got is not None and got != WIRE_PROTOCOL_VERSION:
        raise ProtocolMismatchError(
            f"{what}: trainer speaks wire protocol {got!r}, this worker speaks "
            f"{WIRE_PROTOCOL_VERSION} ({_wheel_hint()})"
        )
    if required:
        return payload
    return {k: v for k, v in payload.items() if k != "wire_protocol"}
