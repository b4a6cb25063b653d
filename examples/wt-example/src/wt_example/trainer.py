"""Trainer side of `example_file`: write the round's tensors into one file.

The transmit step only: core's `ResyncTrainerEngine` runs the round (metadata
on every rank, the checked iteration, start / update / finish, hooks, the
weight version). The file appears atomically (written aside, then renamed),
so a worker polling for it never reads half of it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weight_transfer.backend import (
    ParamMeta,
    ResyncTrainerEngine,
    TrainerInitInfo,
    Transfer,
    VLLMWeightSyncClient,
    WeightSource,
    param_list_payload,
    payload_of,
)
from wt_example.worker import FileInitInfo


@dataclass
class FileTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "example_file"

    directory: str  # shipped to the workers in the handshake, so both sides agree
    timeout_s: float = 60.0


class FileTrainerEngine(ResyncTrainerEngine[FileTrainerInitInfo]):
    init_info_cls = FileTrainerInitInfo

    def __init__(
        self,
        *,
        info: FileTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> None:
        super().__init__(info=info, client=client, source=source)
        self.info: FileTrainerInitInfo = info
        self._written: str | None = None
        self._updates = 0  # update infos made: each names the file its transmit writes

    def connect(self) -> None:
        """The handshake (again, for workers that restarted): the directory to read."""
        os.makedirs(self.info.directory, exist_ok=True)
        worker_info = FileInitInfo(directory=self.info.directory, timeout_s=self.info.timeout_s)
        self.client.init_weight_transfer_engine(payload_of(worker_info))

    def num_chunks(self, metas: list[ParamMeta]) -> int:
        return 1

    def update_info(self, metas: list[ParamMeta]) -> dict[str, Any]:
        """The update's file: a name of its own (a round of chunks has several)."""
        self._updates += 1
        return {**param_list_payload(metas), "filename": f"update-{self._updates}.pt"}

    def transmit(
        self,
        metas: list[ParamMeta],
        pairs: Iterator[tuple[ParamMeta, torch.Tensor]],
        transfer: Transfer,
    ) -> None:
        self._remove_written()
        path = os.path.join(self.info.directory, f"update-{self._updates}.pt")
        try:
            tensors = {meta.name: tensor.detach().cpu() for meta, tensor in pairs}
        except BaseException as error:  # in band: the workers stop waiting for the file
            with open(path + ".abort", "w") as notice:
                notice.write(f"{type(error).__name__}: {error}")
            self._written = path + ".abort"
            raise
        torch.save(tensors, path + ".partial")
        os.replace(path + ".partial", path)
        self._written = path
        transfer.chunk_moved(sum(m.nbytes for m in metas))

    def _remove_written(self) -> None:
        if self._written is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._written)
            self._written = None

    def shutdown(self) -> None:
        self._remove_written()
