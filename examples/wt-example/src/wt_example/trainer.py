"""Trainer side of `example_file`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from weight_transfer.hooks import track_sync
from weight_transfer.payload import payload_of
from weight_transfer.source import checked_iteration
from weight_transfer.transport.dtypes import dtype_name
from wt_example.worker import FileInitInfo


@dataclass
class FileTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "example_file"

    directory: str  # shipped to the workers in the handshake, so both sides agree


class FileTrainerEngine(TrainerWeightTransferEngine[FileTrainerInitInfo]):
    init_info_cls = FileTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool,
        info: FileTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.rounds = 0

    @classmethod
    def trainer_init(
        cls,
        init_info: FileTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> FileTrainerEngine:
        if source is None:
            raise ValueError("example_file is a full-resync backend: pass a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            os.makedirs(init_info.directory, exist_ok=True)
            worker_info = FileInitInfo(directory=init_info.directory)
            client.init_weight_transfer_engine(payload_of(worker_info))
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        assert self.source is not None
        metas = self.source.metadata()  # every rank: may be a collective
        if not self.is_sender:
            for _ in self.source:  # stay in step with the sender's gathers
                pass
            return
        self.rounds += 1
        total = sum(m.nbytes for m in metas)
        with track_sync(
            "example_file", self.rounds, num_params=len(metas), total_bytes=total, num_chunks=1
        ) as tracker:
            tensors = {m.name: t.detach().cpu() for m, t in checked_iteration(metas, self.source)}
            filename = f"round-{self.rounds}.pt"
            path = os.path.join(self.info.directory, filename)
            torch.save(tensors, path)
            self.client.start_weight_update()
            tracker.started()
            try:
                self.client.update_weights(
                    {
                        "filename": filename,
                        "names": [m.name for m in metas],
                        "dtype_names": [dtype_name(m.dtype) for m in metas],
                        "shapes": [list(m.shape) for m in metas],
                    }
                )
                tracker.chunk_moved(total)
                self.client.finish_weight_update(weight_version)
                tracker.weight_version = weight_version
            finally:
                os.unlink(path)
