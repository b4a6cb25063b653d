"""The conformance suite over every first-party backend and wt-example (wt-lite runs
it from its own wheel: tests/core/test_writing_a_backend.py)."""

from __future__ import annotations

import pytest

from weight_transfer.testing.plugin import parametrize_profiles

FIRST_PARTY = [
    "wt_nccl.conformance:PROFILE",
    "wt_ipc.conformance:PROFILE",
    "wt_sparse_nccl.conformance:PROFILE",
    "wt_sharded_rdt.conformance:PROFILE",
    "wt_example.conformance:PROFILE",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not metafunc.config.getoption("--wt-profile", default=None):
        parametrize_profiles(metafunc, FIRST_PARTY)
