"""`parse_payload` / `payload_of`: the typed control-plane dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pytest

from weight_transfer.payload import parse_payload, payload_of


@dataclass
class Info:
    count: int
    flag: bool = False
    ratio: float = 1.0
    shapes: list[list[int]] = field(default_factory=list)
    dims: tuple[int, ...] = ()
    maybe: Optional[int] = None  # noqa: UP045 - the typing spelling must work too
    either: Union[int, str] = 0  # noqa: UP007
    new_style: int | None = None
    table: dict[str, list[str]] = field(default_factory=dict)
    anything: Any = None


def parse(**data: Any) -> Info:
    return parse_payload(Info, data, "update_info")


def test_valid_payload_round_trips() -> None:
    info = parse(
        count=3,
        flag=True,
        ratio=2,
        shapes=[[1, 2], [], [3]],
        dims=[4, 5],
        maybe=None,
        either="x",
        new_style=7,
        table={"k": ["a", "b"]},
        anything={"free": [1, "form"]},
    )
    assert info.count == 3 and info.flag is True and info.ratio == 2
    assert info.shapes == [[1, 2], [], [3]]
    assert info.either == "x" and info.new_style == 7
    assert payload_of(info) == {
        "count": 3,
        "flag": True,
        "ratio": 2,
        "shapes": [[1, 2], [], [3]],
        "dims": [4, 5],
        "either": "x",
        "new_style": 7,
        "table": {"k": ["a", "b"]},
        "anything": {"free": [1, "form"]},
    }


def test_payload_of_leaves_out_none_and_parses_back() -> None:
    info = Info(count=1)
    data = payload_of(info)
    assert "maybe" not in data and "new_style" not in data and "anything" not in data
    assert parse_payload(Info, data, "x") == info


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"count": True}, r"field 'count': expected int, got bool True"),
        ({"count": 1.0}, r"field 'count': expected int, got float"),
        ({"count": 1, "flag": 1}, r"field 'flag': expected bool, got int 1"),
        ({"count": 1, "flag": "true"}, r"field 'flag': expected bool, got str"),
        ({"count": 1, "ratio": False}, r"field 'ratio': expected float, got bool"),
        ({"count": 1, "ratio": "1.0"}, r"field 'ratio': expected float"),
        ({"count": 1, "shapes": [[1], [2, "3"]]}, r"field 'shapes\[1\]\[1\]': expected int"),
        ({"count": 1, "shapes": [[1], 2]}, r"field 'shapes\[1\]': expected a list, got int"),
        ({"count": 1, "shapes": [[True]]}, r"field 'shapes\[0\]\[0\]': expected int, got bool"),
        ({"count": 1, "dims": [1, None]}, r"field 'dims\[1\]': expected int"),
        ({"count": 1, "maybe": "3"}, r"field 'maybe': expected Optional\[int\], got '3'"),
        ({"count": 1, "maybe": True}, r"field 'maybe': expected"),
        ({"count": 1, "either": 1.5}, r"field 'either': expected"),
        ({"count": 1, "new_style": [1]}, r"field 'new_style': expected int \| None"),
        ({"count": 1, "table": {"k": "ab"}}, r"field \"table\['k'\]\": expected a list"),
        ({"count": 1, "table": []}, r"field 'table': expected an object, got list"),
        ({"count": 1, "unknown": 1}, r"unknown field 'unknown' for Info"),
        ({}, r"missing required field 'count' for Info"),
    ],
)
def test_bad_payload_names_the_field(data: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as err:
        parse_payload(Info, data, "update_info")
    assert str(err.value).startswith("update_info: ")


def test_optional_accepts_none_and_values() -> None:
    assert parse(count=0, maybe=None).maybe is None
    assert parse(count=0, maybe=5).maybe == 5
    assert parse(count=0, either=5).either == 5


def test_non_dict_payload_and_non_dataclass() -> None:
    with pytest.raises(ValueError, match=r"init_info: expected an object, got NoneType"):
        parse_payload(Info, None, "init_info")
    with pytest.raises(TypeError, match="is not a dataclass"):
        parse_payload(int, {}, "x")


def test_non_init_fields_are_not_accepted() -> None:
    @dataclass
    class WithDerived:
        a: int
        derived: int = field(init=False, default=0)

    assert parse_payload(WithDerived, {"a": 1}, "x").a == 1
    with pytest.raises(ValueError, match="unknown field 'derived'"):
        parse_payload(WithDerived, {"a": 1, "derived": 2}, "x")


def test_post_init_validation_surfaces() -> None:
    @dataclass
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("field 'n' must be >= 0")

    with pytest.raises(ValueError, match="field 'n' must be >= 0"):
        parse_payload(Checked, {"n": -1}, "x")


def test_a_repeated_parameter_list_decodes_once_per_engine_and_a_changed_one_anew() -> None:
    from weight_transfer.backend import LayoutMemo, ParamListUpdateInfo, param_list_digests

    n = 2000
    data = {
        "names": [f"layers.{i}.w" for i in range(n)],
        "dtype_names": ["bfloat16"] * n,
        "shapes": [[4, 8]] * n,
    }
    mine, theirs = LayoutMemo(), LayoutMemo()  # two engines' memos
    first = mine.metas(parse_payload(ParamListUpdateInfo, data, "update_info"))
    again = mine.metas(parse_payload(ParamListUpdateInfo, data, "update_info"))
    assert all(a is b for a, b in zip(first, again, strict=True))
    elsewhere = theirs.metas(parse_payload(ParamListUpdateInfo, data, "update_info"))
    assert elsewhere == first and elsewhere[0] is not first[0]  # engines share nothing
    changed = {**data, "shapes": [*data["shapes"][:-1], [8, 8]]}
    other = parse_payload(ParamListUpdateInfo, changed, "update_info")
    metas = mine.metas(other)
    assert metas[-1].shape == (8, 8) and metas[0].shape == (4, 8)
    assert mine.digests(other) == param_list_digests(changed) != param_list_digests(data)
    info = parse_payload(ParamListUpdateInfo, {k: list(v) for k, v in data.items()}, "update_info")
    assert mine.digests(info) == param_list_digests(data)
    info.shapes[0] = [1, 1]  # a list changed after the round: the memo kept its own copy
    assert mine.metas(parse_payload(ParamListUpdateInfo, data, "update_info"))[0].shape == (4, 8)
    bad = {**data, "shapes": [*data["shapes"][:-1], [-1, 8]]}
    with pytest.raises(ValueError, match=rf"'shapes\[{n - 1}\]' has a negative dimension"):
        parse_payload(ParamListUpdateInfo, bad, "update_info")
    wrong = {**data, "shapes": [*data["shapes"][:-1], [4, "8"]]}
    with pytest.raises(ValueError, match=rf"field 'shapes\[{n - 1}\]\[1\]': expected int"):
        parse_payload(ParamListUpdateInfo, wrong, "update_info")
    unknown = {**data, "dtype_names": [*data["dtype_names"][:-1], "float8"]}
    with pytest.raises(ValueError, match=rf"'dtype_names\[{n - 1}\]': unknown dtype 'float8'"):
        parse_payload(ParamListUpdateInfo, unknown, "update_info")
