"""Worker side of `example_file`: read the round's file, load it.

The receive step only: core's base class opens the model's loader at
`start_weight_update`, commits it at finish and rolls it back on any failure.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from weight_transfer.backend import (
    ParamListUpdateInfo,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WireProtocolInfo,
)


@dataclass
class FileInitInfo(WireProtocolInfo, WeightTransferInitInfo):
    """The handshake: the shared directory, and how long a round's file may take to appear."""

    directory: str = field(kw_only=True)
    timeout_s: float = field(default=60.0, kw_only=True)


@dataclass
class FileUpdateInfo(ParamListUpdateInfo):
    """The shared parameter list, plus the file this round's tensors are in."""

    filename: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.filename or os.sep in self.filename or self.filename.startswith("."):
            raise ValueError(
                f"update_info: field 'filename' must be a bare file name, got {self.filename!r}"
            )


class FileWorkerEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    info: FileInitInfo | None = None

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self.info = init_info

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        if self.info is None:
            raise RuntimeError("example_file: update_weights before init_weight_transfer_engine")
        path = os.path.join(self.info.directory, update_info.filename)
        deadline = time.monotonic() + self.info.timeout_s
        while not os.path.exists(path):  # the trainer writes it while this call runs
            if os.path.exists(path + ".abort"):
                with open(path + ".abort") as notice:
                    raise RuntimeError(f"example_file: the trainer aborted: {notice.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"example_file: {path} did not appear within {self.info.timeout_s:g}s"
                )
            time.sleep(0.005)
        tensors = torch.load(path, weights_only=True, map_location=self.device)
        batch = []
        for meta in update_info.metas:
            t = tensors.get(meta.name)
            if t is None or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
                raise ValueError(
                    f"example_file: {meta.name!r} in the file does not match update_info"
                )
            batch.append((meta.name, t))
        self.loader.load(batch)

    def shutdown(self) -> None:
        self.info = None
