"""Where a rollout keeps its record: on the GPU, where training reads it in place, or streamed to pinned host memory.

A record of every layer grows with batch x positions (parity records of the qwen3-30b-a3b shape at 256 x 768
positions: 26 GB) and stays allocated through the training step that reads it, beside the policy's activations. Kept
on the device it is free to read; streamed to the host it costs a copy back before training, but device memory stays
bounded. ``trace.records_on_host: auto`` keeps a record on the device unless it would take more than FREE_SHARE of
the memory the device has free when the rollout starts or more than TOTAL_SHARE of the device's memory. The second
bound is there because the free memory at a rollout overstates what a record may take: the training step's
activations come on top of it (a 7.8 GB record, 9.8% of an 80 GB card and under a quarter of its free memory at the
rollout, ran trace_compact's training step on medium-moe out of memory, 2026-12-06). The choice is made once per
rollout shape, so a fit does not flip between the two (each flip would rebuild the engine's kept decode session).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

FREE_SHARE = 0.25
"""The largest part of the device's free memory (at the rollout) a record may take and stay there."""
TOTAL_SHARE = 0.05
"""The largest part of the device's whole memory a record may take and stay there."""


def record_goes_to_host(setting: bool | Literal["auto"], device: torch.device, record_bytes: int,
                        device_memory: Callable[[], tuple[int, int]]) -> bool:
    """True where `setting` asks for host memory, or, with "auto", where a CUDA device's record of `record_bytes`
    would exceed FREE_SHARE of its free or TOTAL_SHARE of its whole memory (`device_memory()` gives both, read only
    then). Off a GPU the record is in host memory already."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cuda" or record_bytes == 0:
        return False
    free, total = device_memory()
    return record_bytes > FREE_SHARE * free or record_bytes > TOTAL_SHARE * total


def cuda_memory(device: torch.device) -> Callable[[], tuple[int, int]]:
    """(free, total) bytes of the device as the CUDA driver counts them (other processes' use included)."""
    return lambda: torch.cuda.mem_get_info(device)


__all__ = ["FREE_SHARE", "TOTAL_SHARE", "cuda_memory", "record_goes_to_host"]
