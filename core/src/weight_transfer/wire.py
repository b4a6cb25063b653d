"""The wire-protocol version of backends built on core's shared layout and codec.

A backend whose two sides depend on core's bucket layout or dtype codec
declares it by mixing `WireProtocolInfo` into its worker init info; its
trainer then ships `wire_protocol` in the handshake (the field's default), and
the worker refuses a different version before parsing anything else, so two
sides that would cut buckets or encode dtypes differently never exchange a
byte.

A backend that does not declare it (a third-party engine written against the
spec alone) parses its init info as it is; a `wire_protocol` that arrives
anyway is still checked, then dropped. Bump `WIRE_PROTOCOL_VERSION` whenever a
change in core alters what crosses the wire (layout rules, codec, handshake
fields).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "WIRE_PROTOCOL_VERSION",
    "WireProtocolInfo",
    "ProtocolMismatchError",
    "check_wire_protocol",
]

# 2: the authenticated store (`secret`), `verify`. 3: every store frame authenticated, the
# two-lane digest, the nccl header (int64[8]) and sparse header (int64[34]), ipc seals and
# LAYOUT frames, the trainer's control key in every init payload.
WIRE_PROTOCOL_VERSION = 3


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
