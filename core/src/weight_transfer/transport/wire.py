"""The wire-protocol version every backend's init handshake carries.

The trainer's init payload holds `wire_protocol`; a worker compares it with its
own before anything else and refuses a different one, so two sides that would
cut chunks or encode dtypes differently never exchange a byte. Bump
`WIRE_PROTOCOL_VERSION` whenever a change in core alters what crosses the wire
(layout rules, codec, handshake fields).
"""

from __future__ import annotations

from typing import Any

__all__ = ["WIRE_PROTOCOL_VERSION", "ProtocolMismatchError", "check_wire_protocol"]

WIRE_PROTOCOL_VERSION = 1


class ProtocolMismatchError(ValueError):
    """The trainer and the worker speak different wire protocols."""


def _wheel_hint() -> str:
    from weight_transfer import __version__

    return (
        f"this worker has wt-core {__version__}; install the same wt-core version "
        "(and matching backend wheels) in the trainer and the inference environment"
    )


def check_wire_protocol(payload: dict[str, Any], *, what: str = "init_info") -> None:
    """Raise `ProtocolMismatchError` unless `payload` speaks this wire protocol."""
    if not isinstance(payload, dict):
        raise ValueError(f"{what}: expected an object, got {type(payload).__name__}")
    got = payload.get("wire_protocol")
    if got is None:
        raise ProtocolMismatchError(
            f"{what}: missing field 'wire_protocol'; the trainer predates wire protocol "
            f"{WIRE_PROTOCOL_VERSION} or is not a wt trainer ({_wheel_hint()})"
        )
    if got != WIRE_PROTOCOL_VERSION:
        raise ProtocolMismatchError(
            f"{what}: trainer speaks wire protocol {got!r}, this worker speaks "
            f"{WIRE_PROTOCOL_VERSION} ({_wheel_hint()})"
        )
