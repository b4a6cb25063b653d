"""The dtype codec allowlist."""

from __future__ import annotations

import pytest
import torch

from weight_transfer.payload import WIRE_DTYPES, dtype_from_name, dtype_name


def test_every_allowed_dtype_round_trips_under_its_torch_name() -> None:
    for name, dtype in WIRE_DTYPES.items():
        assert dtype_name(dtype) == name
        assert dtype_from_name(name) is dtype
        assert getattr(torch, name) is dtype
    assert {"float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool"} <= set(WIRE_DTYPES)


@pytest.mark.parametrize(
    "name", ["Tensor", "cuda", "float128", "load", "torch.float32", "", "FLOAT32", None, 5]
)
def test_names_outside_the_allowlist_are_refused_naming_the_field(name: object) -> None:
    with pytest.raises(ValueError) as err:
        dtype_from_name(name, field="dtype_names[3]")  # type: ignore[arg-type]
    msg = str(err.value)
    assert msg.startswith(f"field 'dtype_names[3]': unknown dtype {name!r}")
    assert "allowed: float64, float32" in msg


def test_default_field_name() -> None:
    with pytest.raises(ValueError, match=r"^field 'dtype': unknown dtype 'complex64'"):
        dtype_from_name("complex64")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.quint8])
def test_dtypes_that_cannot_travel_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"dtype {dtype} cannot travel; allowed: "):
        dtype_name(dtype)
