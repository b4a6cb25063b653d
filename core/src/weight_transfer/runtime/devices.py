"""The device a trainer sends from, and waiting for a device's queued work."""

from __future__ import annotations

import torch

__all__ = ["trainer_device", "synchronize_device"]


def trainer_device(device: str | None) -> torch.device:
    """`device`, or by default the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize_device(device: torch.device) -> None:
    """Wait for queued work on `device`; a no-op for devices without a queue (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            accelerator.synchronize(device)
