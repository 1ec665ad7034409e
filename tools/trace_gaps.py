"""Where the GPU waits in a profiled call: the device's idle gaps in a torch.profiler Chrome trace, and what the host
was doing in them.

A step whose wall time is well above its device's busy time (bench_train.py --profile, StepProfiler) is waiting on
something neither profiler table shows: the host enqueueing too slowly, a synchronous runtime call (a cudaFree from
the caching allocator, a blocking copy), or a sync. Here each gap between the device's kernels and copies is
charged to the host op that launched the kernel ending it (the innermost CPU op around that launch: the host was
late inside it), and the CUDA runtime calls that ran during the gaps are summed (a long cudaFree or synchronize
there is the device being drained, not the host being slow).

    python3 tools/trace_gaps.py step_fake_quant.json.gz [--min-us 5] [--rows 20]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Gaps:
    """The device's idle time in a trace, charged to what the host was doing."""

    span_us: float = 0.0
    """From the first device event's start to the last one's end."""
    busy_us: float = 0.0
    idle_us: float = 0.0
    """Summed gaps of at least min_us between device events (shorter ones are launch latency, not waiting)."""
    gaps: int = 0
    by_launching_op: dict[str, float] = field(default_factory=dict)
    """Idle us per innermost host op around the launch of the kernel that ended the gap."""
    runtime_in_gaps: dict[str, float] = field(default_factory=dict)
    """us of each CUDA runtime call overlapping a gap (clipped to the gap)."""


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _complete(events: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == category and "dur" in e]


def _merged(intervals: list[tuple[float, float, int | None]]) -> list[tuple[float, float, int | None]]:
    """Overlapping device intervals (several streams) merged; each keeps the correlation of its first event."""
    out: list[tuple[float, float, int | None]] = []
    for start, end, corr in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end), out[-1][2])
        else:
            out.append((start, end, corr))
    return out


def _innermost(ops: list[dict[str, Any]], queries: list[tuple[float, float]]) -> dict[str, float]:
    """Each query's weight summed per the innermost op (shortest enclosing) of one host thread at its time: queries
    (host ts, weight), ops that thread's complete CPU ops (properly nested on one thread)."""
    charged: dict[str, float] = defaultdict(float)
    ops = sorted(ops, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    stack: list[tuple[float, str]] = []  # (end, name) of the open ops, outermost first
    i = 0
    for ts, weight in sorted(queries):
        while i < len(ops) and float(ops[i]["ts"]) <= ts:
            op = ops[i]
            while stack and stack[-1][0] < float(op["ts"]):
                stack.pop()
            stack.append((float(op["ts"]) + float(op["dur"]), op["name"]))
            i += 1
        while stack and stack[-1][0] < ts:
            stack.pop()
        charged[stack[-1][1] if stack else "(no op)"] += weight
    return charged


def _overlaps(calls: list[dict[str, Any]], gaps: list[tuple[float, float]]) -> dict[str, float]:
    """us of each runtime call inside the gaps (start, end), sorted by start and disjoint."""
    starts = [start for start, _ in gaps]
    out: dict[str, float] = defaultdict(float)
    for call in calls:
        begin, end = float(call["ts"]), float(call["ts"]) + float(call["dur"])
        k = max(bisect.bisect_right(starts, begin) - 1, 0)
        while k < len(gaps) and gaps[k][0] < end:
            overlap = min(end, gaps[k][1]) - max(begin, gaps[k][0])
            if overlap > 0:
                out[call["name"]] += overlap
            k += 1
    return out


def device_gaps(events: list[dict[str, Any]], min_us: float = 5.0) -> Gaps:
    device = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("correlation"))
              for c in DEVICE_CATEGORIES for e in _complete(events, c)]
    if not device:
        raise ValueError("the trace holds no device events (kernels or copies): was it profiled with CUDA activity?")
    runtime = _complete(events, "cuda_runtime") + _complete(events, "cuda_driver")
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    merged = _merged(device)
    out = Gaps(span_us=merged[-1][1] - merged[0][0], busy_us=sum(end - start for start, end, _ in merged))
    gaps: list[tuple[float, float]] = []
    queries: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    by_op: dict[str, float] = defaultdict(float)
    for (_, prev_end, _), (start, _, corr) in zip(merged, merged[1:], strict=False):
        if start - prev_end < min_us:
            continue
        gaps.append((prev_end, start))
        launch = launches.get(corr)
        if launch is None:
            by_op["(launch not in trace)"] += start - prev_end
        else:
            queries[(launch["pid"], launch["tid"])].append((float(launch["ts"]), start - prev_end))
    ops = _complete(events, "cpu_op")
    for thread, points in queries.items():
        for name, us in _innermost([op for op in ops if (op["pid"], op["tid"]) == thread], points).items():
            by_op[name] += us
    out.gaps, out.idle_us = len(gaps), sum(end - start for start, end in gaps)
    out.by_launching_op = dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
    out.runtime_in_gaps = dict(sorted(_overlaps(runtime, gaps).items(), key=lambda kv: -kv[1]))
    return out


def report(g: Gaps, rows: int) -> str:
    lines = [f"device span {g.span_us / 1e3:.2f} ms, busy {g.busy_us / 1e3:.2f} ms, idle in {g.gaps} gaps "
             f"{g.idle_us / 1e3:.2f} ms", "", "| host op that launched the kernel after the gap | idle ms |",
             "|---|---:|"]
    lines += [f"| {name} | {us / 1e3:.2f} |" for name, us in list(g.by_launching_op.items())[:rows]]
    lines += ["", "| CUDA runtime call during the gaps | ms |", "|---|---:|"]
    lines += [f"| {name} | {us / 1e3:.2f} |" for name, us in list(g.runtime_in_gaps.items())[:rows]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a torch.profiler Chrome trace (.json or .json.gz)")
    parser.add_argument("--min-us", type=float, default=5.0, help="shorter gaps are launch latency, not waiting")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    print(report(device_gaps(load(args.trace), args.min_us), args.rows))


if __name__ == "__main__":
    main()
