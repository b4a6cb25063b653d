"""Worker side of `example_file`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weight_transfer.loading import WeightLoader
from weight_transfer.transport.dtypes import dtype_from_name


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    directory: str = field(kw_only=True)


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    filename: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        for name in ("dtype_names", "shapes"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(f"update_info: field {name!r} must have one entry per name")
        if os.sep in self.filename or self.filename.startswith("."):
            raise ValueError(
                f"update_info: field 'filename' must be a bare file name, got {self.filename!r}"
            )


class FileWorkerEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    directory: str | None = None
    loader: WeightLoader | None = None

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        self.directory = init_info.directory

    def start_weight_update(self) -> None:
        self.loader = self.new_loader()
        self.loader.begin()

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        if self.directory is None or self.loader is None:
            raise RuntimeError("example_file: update_weights before init / start")
        tensors = torch.load(
            os.path.join(self.directory, update_info.filename),
            weights_only=True,
            map_location=self.device,
        )
        batch = []
        for i, name in enumerate(update_info.names):
            t = tensors[name]
            dtype = dtype_from_name(update_info.dtype_names[i], field=f"dtype_names[{i}]")
            if t.dtype != dtype or list(t.shape) != update_info.shapes[i]:
                raise ValueError(f"example_file: {name!r} in the file does not match update_info")
            batch.append((name, t))
        self.loader.load(batch)

    def finish_weight_update(self) -> None:
        if self.loader is not None:
            self.loader.commit()
            self.loader = None

    def abort_weight_update(self) -> None:
        if self.loader is not None:
            self.loader.abort()
            self.loader = None

    def shutdown(self) -> None:
        self.directory = None
