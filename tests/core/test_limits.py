"""Every size and wait the caller or the wire chooses is bounded, and a refusal
names the field, the value and the limit."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from tests.core.helpers import ExampleNet
from weight_transfer import WeightTransferConfig, WeightTransferEngineFactory
from weight_transfer.backend import ParamMeta, parse_payload
from weight_transfer.payload import WIRE_PROTOCOL_VERSION
from weight_transfer.runtime.limits import MAX_TIMEOUT_S, check_declared, host_memory_bytes
from wt_kits.group import GroupInitInfo
from wt_kits.group.auth import new_secret


def _group(**extra: Any) -> dict[str, Any]:
    return {
        "wire_protocol": WIRE_PROTOCOL_VERSION,
        "master_address": "127.0.0.1",
        "master_port": 29999,
        "world_size": 3,
        "secret": new_secret(),
        **extra,
    }


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0, 1e6, 1e300])
def test_a_timeout_outside_its_range_is_refused_naming_it(bad: float) -> None:
    with pytest.raises(ValueError) as err:
        parse_payload(GroupInitInfo, _group(timeout_s=bad), "init_info")
    message = str(err.value)
    assert "field 'timeout_s'" in message and f"(0, {MAX_TIMEOUT_S:g}]" in message
    assert repr(bad) in message


def test_rank_offset_and_address_are_checked_at_parse_time() -> None:
    with pytest.raises(ValueError, match=r"field 'rank_offset' must be in \[0, 2\], got -1"):
        parse_payload(GroupInitInfo, _group(rank_offset=-1), "init_info")
    with pytest.raises(ValueError, match="field 'master_address' must not be empty"):
        parse_payload(GroupInitInfo, _group(master_address=""), "init_info")


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("packed_num_buffers", 10**8, r"'packed_num_buffers' must be in \[1, 16\], got 100000000"),
        ("packed_num_buffers", 10**10, r"must be in \[1, 16\], got 10000000000"),
        ("packed_num_buffers", 0, r"must be in \[1, 16\], got 0"),
        ("packed_buffer_size_bytes", 8, r"'packed_buffer_size_bytes' must be in \[64, "),
        ("packed_min_bucket_bytes", -1, r"'packed_min_bucket_bytes' must be in \[0, "),
    ],
)
def test_nccl_wire_params_are_bounded(field: str, value: int, pattern: str) -> None:
    engine = _nccl_engine()
    with pytest.raises(ValueError, match=pattern):
        engine.parse_init_info(_group(**{field: value}))


def test_staging_larger_than_the_host_allows_is_refused() -> None:
    engine = _nccl_engine()
    size = host_memory_bytes() // 4
    with pytest.raises(ValueError, match=r"needs \d+ bytes of staging, over the limit of \d+"):
        engine.parse_init_info(_group(packed_buffer_size_bytes=size, packed_num_buffers=3))


def _nccl_engine() -> Any:
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig("nccl"), None, "cpu", ExampleNet()
    )


def test_a_round_larger_than_the_model_is_refused_before_anything_is_allocated() -> None:
    model = ExampleNet()
    numel = sum(p.numel() for p in model.parameters())
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"field 'shapes\[1\]' declares 'huge' with 10{12}"):
        check_declared(
            [ParamMeta("ok", torch.float32, (3,)), ParamMeta("huge", torch.float32, (10**12,))],
            model,
            what="update_info",
        )
    assert time.monotonic() - t0 < 1.0
    many = [ParamMeta(f"p{i}", torch.float32, (numel,)) for i in range(3)]
    with pytest.raises(ValueError, match=rf"declares {3 * numel} elements, over the limit"):
        check_declared(many, model, what="update_info")
    check_declared([ParamMeta("p", torch.float32, (numel,))] * 2, model, what="update_info")
    # a model with no parameters of its own: the host's limit still applies
    with pytest.raises(ValueError, match="bytes, over the limit of"):
        check_declared([ParamMeta("x", torch.float32, (10**12,))], torch.nn.ReLU(), what="u")


def test_a_layout_that_passed_is_not_walked_again_and_a_changed_one_is_checked() -> None:
    model = ExampleNet()
    numel = sum(p.numel() for p in model.parameters())
    fits = [ParamMeta(f"p{i}", torch.float32, (numel // 4,)) for i in range(2)]
    check_declared(fits, model, what="update_info")
    walks = []
    original = model.parameters
    model.parameters = lambda *a, **k: walks.append(1) or original(*a, **k)  # type: ignore[method-assign]
    check_declared(list(fits), model, what="update_info")
    assert walks == []  # the same layout: no walk of the model
    too_many = [*fits, ParamMeta("p2", torch.float32, (3 * numel,))]
    with pytest.raises(ValueError, match=r"declares 'p2' with"):
        check_declared(too_many, model, what="update_info")
    assert walks == [1]
