"""wt-nccl's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_nccl.conformance:PROFILE
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_transfer.kits.group import free_port
from weight_transfer.testing.profile import Profile


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        "127.0.0.1", free_port(), 1 + workers, rank=0, timeout_s=timeout_s,
        replace_trainer=replace, **wire,
    )  # fmt: skip


PROFILE = Profile(
    "nccl",
    trainer_info,
    wire_modes={
        "packed": {"packed": True, "packed_buffer_size_bytes": 1 << 20},
        "packed-small-buffers": {
            "packed": True,
            "packed_buffer_size_bytes": 2048,
            "packed_min_bucket_bytes": 0,
            "packed_num_buffers": 3,
        },
        "unpacked": {"packed": False},
        "verified-small-buffers": {
            "packed": True,
            "packed_buffer_size_bytes": 2048,
            "packed_min_bucket_bytes": 0,
            "verify": True,
        },
        "verified-unpacked": {"packed": False, "verify": True},
    },
)
