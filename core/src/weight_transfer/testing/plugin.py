"""The pytest plugin that runs the conformance suite over the profiles it is given.

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile my_backend.conformance:PROFILE

`--wt-profile module:NAME` (repeatable) names a `Profile`; every test of the
suite runs once per profile, and the workers one profile starts are shared by
that profile's tests.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--wt-profile",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="a weight_transfer.testing.Profile to run the conformance suite on",
    )


def load_profiles(targets: list[str]) -> list[Any]:
    from weight_transfer.testing.profile import Profile
    from weight_transfer.testing.workers import load_object

    profiles = []
    for target in targets:
        if ":" not in target:
            raise pytest.UsageError(f"--wt-profile {target!r}: expected MODULE:NAME")
        profile = load_object(target)
        if not isinstance(profile, Profile):
            raise pytest.UsageError(
                f"--wt-profile {target!r} is a {type(profile).__name__}, not a Profile"
            )
        profiles.append(profile)
    return profiles


def parametrize_profiles(metafunc: pytest.Metafunc, targets: list[str]) -> None:
    """Run a test that takes `wt_profile` once per profile `targets` name (module-scoped,
    so one profile's tests share its workers)."""
    if "wt_profile" in metafunc.fixturenames and targets:
        profiles = load_profiles(targets)
        metafunc.parametrize(
            "wt_profile", profiles, ids=[p.backend for p in profiles], scope="module"
        )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_profiles(metafunc, metafunc.config.getoption("--wt-profile"))
