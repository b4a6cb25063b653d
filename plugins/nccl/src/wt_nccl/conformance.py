"""wt-nccl's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_nccl.conformance:PROFILE
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_transfer.testing.profile import STREAM_WIRE_MODES, Profile
from wt_kits.group import free_port


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + workers, rank=0, timeout_s=timeout_s,
        replace_trainer=replace, **wire,
    )  # fmt: skip


PROFILE = Profile("nccl", trainer_info, wire_modes=STREAM_WIRE_MODES)
