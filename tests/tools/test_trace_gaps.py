"""tools/trace_gaps.py charges the device's idle gaps in a Chrome trace to the host op that launched the kernel after
each gap, and sums the runtime calls inside the gaps (a trace written by hand, each number known)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from trace_gaps import device_gaps, load  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0 if cat != "kernel" else 1, "tid": tid}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _trace() -> list[dict]:
    """Host thread 1: a forward op (0-300) holding a quantize op (100-250) that launches kernel 3 at 240 after a
    cudaFree (110-230); thread 2 (autograd's) launches kernel 4 at 400 outside any op. Device: kernels 1 and 2 on
    two streams overlap (10-60, 50-90), kernel 3 at 250-260 (gap 160 us), kernel 4 at 402-410 (gap 142 us), kernel
    5 right after it (gap 2 us: launch latency, not counted)."""
    return [
        _x("cpu_op", "forward", 0, 300), _x("cpu_op", "quantize", 100, 150),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, corr=1), _x("cuda_runtime", "cudaLaunchKernel", 8, 2, corr=2),
        _x("cuda_runtime", "cudaFree", 110, 120), _x("cuda_runtime", "cudaLaunchKernel", 240, 3, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 400, 1, tid=2, corr=4),
        _x("cuda_runtime", "cudaLaunchKernel", 401, 1, tid=2, corr=5),
        _x("kernel", "k1", 10, 50, tid=7, corr=1), _x("kernel", "k2", 50, 40, tid=8, corr=2),
        _x("kernel", "k3", 250, 10, tid=7, corr=3), _x("kernel", "k4", 402, 8, tid=7, corr=4),
        _x("kernel", "k5", 412, 3, tid=7, corr=5),
    ]


def test_each_gap_is_charged_to_the_op_that_launched_the_kernel_after_it() -> None:
    g = device_gaps(_trace(), min_us=5)
    assert (g.span_us, g.busy_us, g.gaps, g.idle_us) == (405, 80 + 10 + 8 + 3, 2, 160 + 142)
    assert g.by_launching_op == {"quantize": 160, "(no op)": 142}
    assert g.runtime_in_gaps == {"cudaFree": 120, "cudaLaunchKernel": 3 + 1 + 1}  # launches 3, 4 and 5 lie in the gaps


def test_the_cli_reads_a_gzipped_trace_and_refuses_one_without_device_events(tmp_path: Path) -> None:
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load(path)) == len(_trace())
    out = subprocess.run([sys.executable, "tools/trace_gaps.py", str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "idle in 2 gaps 0.30 ms" in out and "| quantize | 0.16 |" in out and "| cudaFree | 0.12 |" in out
    with pytest.raises(ValueError, match="no device events"):
        device_gaps([e for e in _trace() if e["cat"] != "kernel"])
