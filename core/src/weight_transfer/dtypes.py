"""The dtype codec: torch dtypes to wire names and back, through an allowlist.

A wire name is the dtype's attribute name in torch (`"bfloat16"`). Decoding
never looks a name up on the `torch` module, so a payload cannot name an
arbitrary torch attribute.
"""

from __future__ import annotations

import torch

__all__ = ["WIRE_DTYPES", "dtype_name", "dtype_from_name"]

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
