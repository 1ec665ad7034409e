"""Where a rollout keeps its record: on the GPU, where training reads it in place, or streamed to pinned host memory.

A record of every layer grows with batch x positions (parity records of the qwen3-30b-a3b shape at 256 x 768
positions: 26 GB) and stays allocated through the training step that reads it, beside the policy's activations. Kept
on the device it is free to read; streamed to the host it costs a copy back before training, but device memory stays
bounded. ``trace.records_on_host: auto`` keeps a record on the device unless it would take more than
DEVICE_SHARE of the memory the device has free when the rollout starts; the choice is made once per rollout shape,
so a fit does not flip between the two (each flip would rebuild the engine's kept decode session).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

DEVICE_SHARE = 0.25
"""The largest part of the device's free memory a record may take and stay there."""


def record_goes_to_host(setting: bool | Literal["auto"], device: torch.device, record_bytes: int,
                        free_bytes: Callable[[], int]) -> bool:
    """True where `setting` asks for host memory, or, with "auto", where a CUDA device's record of `record_bytes`
    would exceed DEVICE_SHARE of `free_bytes()` (read only then). Off a GPU the record is in host memory already."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cuda" or record_bytes == 0:
        return False
    return record_bytes > DEVICE_SHARE * free_bytes()


def cuda_free_bytes(device: torch.device) -> Callable[[], int]:
    """The device's free memory as the CUDA driver counts it (other processes' use included)."""
    return lambda: torch.cuda.mem_get_info(device)[0]


__all__ = ["DEVICE_SHARE", "cuda_free_bytes", "record_goes_to_host"]
