"""wt-sharded-rdt's conformance profile (`weight_transfer.testing`):

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile wt_sharded_rdt.conformance:PROFILE

Over the loopback transport, which reaches producers in the trainer's own
process: the suite's workers are threads of the test process
(`in_process`), and the killed-worker scenario is left to the NIXL tests. A
worker writes the slices its dry run recorded at init, not through the
model's `load_weights` (`loads_by_name=False`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from weight_transfer.testing.profile import Profile

_trainers = itertools.count()


def trainer_info(
    *, workers: int, wire: Mapping[str, Any], timeout_s: float, replace: bool, workdir: str
) -> Any:
    from wt_sharded_rdt import ShardedRDTTrainerInitInfo

    return ShardedRDTTrainerInitInfo(
        rank=0,
        num_consumers=workers,
        transport="loopback",
        producer_prefix=f"wt-conformance-{os.getpid()}-{next(_trainers)}",
        timeout_s=timeout_s,
        stall_timeout_s=timeout_s,
        replace_trainer=replace,
        **wire,
    )


PROFILE = Profile(
    "sharded_rdt",
    trainer_info,
    wire_modes={"default": {}, "small-chunks": {"chunk_bytes": 4096}, "verified": {"verify": True}},
    loads_by_name=False,
    in_process=True,
)
