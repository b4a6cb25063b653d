"""The device a trainer sends from, and waiting for a device's queued work."""

from __future__ import annotations

import torch

__all__ = ["trainer_device", "device_name", "synchronize_device"]


def trainer_device(device: str | None) -> torch.device:
    """`device`, or by default the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(device: str | torch.device | int | None, *, what: str) -> str | None:
    """`device` as a trainer init info keeps it: a device string (`"cpu"`,
    `"cuda:1"`), given one, a `torch.device`, or a CUDA index (as frameworks pass
    `accelerator.device` or `current_device()`); None stays None. `ValueError`
    names the field."""
    if device is None:
        return None
    try:
        if isinstance(device, int) and not isinstance(device, bool):
            return str(torch.device("cuda", device))
        if isinstance(device, (str, torch.device)):
            return str(torch.device(device))
    except (RuntimeError, ValueError):
        pass
    raise ValueError(
        f"{what}: field 'device' must be a device (a string, a torch.device or a CUDA "
        f"index), got {device!r}"
    )


def synchronize_device(device: torch.device) -> None:
    """Wait for queued work on `device`; a no-op for devices without a queue (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            accelerator.synchronize(device)
