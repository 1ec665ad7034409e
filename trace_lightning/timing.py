"""Wall-clock timing that is honest on a GPU (a fit step's phases, an engine's prefill), and the peak memory used.

CUDA kernels run asynchronously: a phase timed by the host clock alone measures its launches. So each reading
waits for the device first; on the CPU it is just the clock.
"""

from __future__ import annotations

import time

import torch


def device_time(device: torch.device) -> float:
    """perf_counter() after the device has finished what was queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def peak_memory_gib(device: torch.device, reset: bool = True) -> float | None:
    """Peak allocated GPU memory since the last reset (GiB), or None off CUDA; resets the peak by default, so each
    reading covers one step."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak
