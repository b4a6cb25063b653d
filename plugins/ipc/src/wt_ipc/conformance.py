"""wt-ipc's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_ipc.conformance:PROFILE
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_transfer.testing.profile import STREAM_WIRE_MODES, Profile


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_ipc import IPCTrainerInitInfo

    # num_workers left out: derived from the workers that attach (as a port of vLLM's
    # examples, which do not pass it, has it)
    return IPCTrainerInitInfo(rank=0, timeout_s=timeout_s, replace_trainer=replace, **wire)


PROFILE = Profile("ipc", trainer_info, wire_modes=STREAM_WIRE_MODES)
