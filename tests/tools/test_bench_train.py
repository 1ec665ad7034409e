"""tools/bench_train.py runs the training micro-step per variant on the CPU, and its expert-GEMM variants compute the
same logprobs (the grouped GEMM the fits use against the loop over experts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_rows_and_identical_logprobs() -> None:
    out = subprocess.run(
        [sys.executable, "tools/bench_train.py", "--preset", "debug-moe", "--micro-batch", "2", "--seq", "24",
         "--reps", "1", "--device", "cpu", "--variants", "loop, fp32", "grouped, fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ") and "ms a micro-step" not in line]
    rows = [line.split("|")[1:-1] for line in lines]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (hook, variant) for hook in ("none", "fake_quant", "fake_quant, step cache")
        for variant in ("loop, fp32", "grouped, fp32")
    ]
    assert all(float(r[2]) > 0 for r in rows)
    assert all(r[5].strip() == "0.0/0.0/0.0" for r in rows)  # no CUDA allocator on the CPU
    assert all(float(r[6]) >= 0.0 for r in rows)  # the collector's pauses, timed
    assert all(float(r[7]) == 0.0 for r in rows)  # grouped against loop, each hook: the same logprobs to the bit


def test_bench_train_guided_row_rounds_to_an_engine_record() -> None:
    """The guided hook's row: parity records the FP4 engine captured for the bench's tokens, padding in the first
    row; its micro-step runs and is timed beside plain fake quant."""
    out = subprocess.run(
        [sys.executable, "tools/bench_train.py", "--preset", "debug-moe", "--micro-batch", "2", "--seq", "40",
         "--reps", "1", "--device", "cpu", "--variants", "grouped, fp32", "--hooks", "fake_quant, step cache",
         "guided parity, step cache", "--pad", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "micro-step" not in line]
    assert [r[0].strip() for r in rows] == ["fake_quant, step cache", "guided parity, step cache"]
    assert all(float(r[2]) > 0 for r in rows)


def test_bench_train_writes_each_profiled_hooks_chrome_trace(tmp_path: Path) -> None:
    """--profile --trace PREFIX: one Chrome trace a hook, of the micro-step whose table is printed."""
    out = subprocess.run(
        [sys.executable, "tools/bench_train.py", "--preset", "debug-moe", "--micro-batch", "1", "--seq", "17",
         "--reps", "1", "--device", "cpu", "--variants", "grouped, fp32", "--hooks", "none", "fake_quant",
         "--profile", "--trace", str(tmp_path / "step_")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert traces == ["step_fake_quant.json", "step_none.json"]
    assert all(f"Chrome trace: {tmp_path / name}" in out for name in traces)
    events = json.loads((tmp_path / "step_fake_quant.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)  # the micro-step's ops, not an empty trace
