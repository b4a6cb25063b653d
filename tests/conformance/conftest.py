"""The conformance suite over every first-party backend and wt-example (wt-lite runs
it from its own wheel: tests/core/test_writing_a_backend.py)."""

from __future__ import annotations

import pytest

from weight_transfer.testing.plugin import load_profiles

FIRST_PARTY = [
    "wt_nccl.conformance:PROFILE",
    "wt_ipc.conformance:PROFILE",
    "wt_example.conformance:PROFILE",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "wt_profile" in metafunc.fixturenames and not metafunc.config.getoption(
        "--wt-profile", default=None
    ):
        profiles = load_profiles(FIRST_PARTY)
        metafunc.parametrize(
            "wt_profile", profiles, ids=[p.backend for p in profiles], scope="module"
        )
