"""wt-example's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_example.conformance:PROFILE

Its worker cannot tell whether its trainer lives (a directory has no liveness),
so a second trainer takes the engine over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_transfer.testing.profile import Profile


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_example.trainer import FileTrainerInitInfo

    return FileTrainerInitInfo(workdir, rank=0, timeout_s=timeout_s, **wire)


PROFILE = Profile("example_file", trainer_info, knows_liveness=False)
