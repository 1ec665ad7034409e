"""What is live on the GPU at a call's peak, and where it was allocated: the CUDA caching allocator's own event trace
(torch.cuda.memory._record_memory_history) replayed to its highest point. For a peak that exceeds the engine's
memory plan, this names the tensors the plan leaves out (tools/bench_engine.py --peak-blocks)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

FREES = ("free_requested", "free_completed")


def live_at_peak(events: Iterable[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """(peak bytes allocated above the trace's start, the blocks live at that peak by address) from allocator trace
    events ("alloc", then "free_requested" and / or "free_completed": a block counts until the first of them).
    Blocks allocated before the trace began are not in it, so frees of them are skipped."""
    events = list(events)
    live, now, peak, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > peak:
                peak, at = now, i
        elif e["action"] in FREES and e["addr"] in live:
            now -= live.pop(e["addr"])["size"]
    blocks: dict[int, dict[str, Any]] = {}
    for e in events[: at + 1]:  # again, up to the peak
        if e["action"] == "alloc":
            blocks[e["addr"]] = e
        elif e["action"] in FREES:
            blocks.pop(e["addr"], None)
    return peak, blocks


def where(block: dict[str, Any], package: str = "trace_lightning") -> str:
    """The innermost frame of `package` that allocated a block (file:line function), else its innermost frame."""
    frames = block.get("frames") or []
    ours = [f for f in frames if package in f.get("filename", "")]
    f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"


def grouped(blocks: dict[int, dict[str, Any]], top: int = 12) -> list[tuple[int, int, str]]:
    """(bytes, blocks, allocation site) of the `top` sites holding the most bytes, largest first."""
    size, count = Counter(), Counter()
    for b in blocks.values():
        site = where(b)
        size[site] += b["size"]
        count[site] += 1
    return [(n, count[site], site) for site, n in size.most_common(top)]


def peak_blocks(fn: Callable[[], object], device: torch.device, max_entries: int = 2_000_000
                ) -> tuple[int, list[tuple[int, int, str]]]:
    """Run fn with the CUDA allocator recording (Python stacks) and return its peak above the start and the sites
    holding the most bytes at that peak."""
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    peak, blocks = live_at_peak(snapshot["device_traces"][index])
    return peak, grouped(blocks)
