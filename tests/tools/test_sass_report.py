"""tools/sass_report.py on the FP4 GEMMs (sm_90 SASS, compiled on the CPU): properties the parity tests cannot see.

A synchronous global load inside a K loop costs a memory latency per K tile (H200, 2026-12-03: the scale
bytes, until their loads were written so that Triton pipelines them through cp.async). The tool runs in its own
process: the kernel tests import the kernels under Triton's interpreter, which cannot compile them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sass_report.py"
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MEASURED_TRITON = "3.9."
"""Exact instruction counts were read off this Triton's SASS; another version may unroll or split differently, so
there only the version-independent properties are asserted (no loads or spills where there were none, shares)."""
MEASURED = triton.__version__.startswith(MEASURED_TRITON)
pytestmark = pytest.mark.slow  # each report compiles the kernels for sm_90 in a subprocess: ~2 minutes in all


def sass_reports(out: Path, *settings: str, cases: tuple[str, ...] = ("gate_up", "down", "linear")) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL), "--out", str(out), "--cases", *cases,
                          "--set", *settings], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [ast.literal_eval(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["tag"]: r for r in rows}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return sass_reports(tmp_path_factory.mktemp("sass"), "WORDS=1", "EVEN_K=1")


@pytest.fixture(scope="module")
def tiled_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return sass_reports(tmp_path_factory.mktemp("sass_tiled"), "WORDS=1", "TILED=1", "EVEN_K=1")


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="triton's bundled ptxas / cuobjdump are needed to compile for sm_90")
@pytest.mark.parametrize("case", ["gate_up", "down", "linear"])
def test_weight_gemm_k_loops_load_only_through_cp_async(reports: dict[str, dict], case: str) -> None:
    report = reports[case]
    assert report["loop_LDG"] == 0, report  # weights, scales and activations all arrive by cp.async
    assert report["loop_LDGSTS"] > 0 and report["HGMMA"] > 0, report  # pipelined loads, Hopper wgmma
    assert report["LDL"] == report["STL"] == 0, report  # no register spills


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="triton's bundled ptxas / cuobjdump are needed to compile for sm_90")
@pytest.mark.parametrize("case", ["gate_up", "down", "linear"])
def test_tiled_weights_arrive_in_16_byte_copies(tiled_reports: dict[str, dict], case: str) -> None:
    """Weights in tiles on even K steps: every cp.async of the loop but the small scale tiles (4 bytes a thread) is
    16 bytes wide (the column mask or an unprovable split-K alignment had held the word loads to 8)."""
    report = tiled_reports[case]
    scale_copies = 2 if case == "gate_up" else 1  # gate and up scale tiles / one weight's
    if MEASURED:
        assert report["loop_LDGSTS_16B"] == report["loop_LDGSTS"] - scale_copies, report
    else:  # each K step copies an activation tile, a weight tile per scale tile, and the scales
        narrow = report["loop_LDGSTS"] - report["loop_LDGSTS_16B"]
        assert 0 < narrow * (2 * scale_copies + 1) <= scale_copies * report["loop_LDGSTS"], report


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="triton's bundled ptxas / cuobjdump are needed to compile for sm_90")
def test_programmatic_dependent_launch_waits_before_any_global_access(tmp_path: Path) -> None:
    """With PDL a kernel's programs may start while the previous kernel still runs: each must wait
    (griddepcontrol.wait = ACQBULK) before its first global load or store, or it could read inputs not yet written
    or overwrite buffers still being read. Its successor launches as its programs exit, never earlier (no
    griddepcontrol.launch_dependents = PREEXIT: the early launch measured slower at batch 64 / 256). Without PDL the
    kernels carry neither instruction."""
    cases = ("linear", "attention", "nvfp4_rows", "router")
    with_pdl = sass_reports(tmp_path / "pdl", "PDL=1", cases=cases)
    plain = sass_reports(tmp_path / "plain", "PDL=0", cases=cases)
    for case in cases:
        if MEASURED:
            assert with_pdl[case]["ACQBULK"] == 1 and with_pdl[case]["PREEXIT"] == 0, with_pdl[case]
        assert with_pdl[case]["ACQBULK"] >= 1 and with_pdl[case]["PREEXIT"] == 0, with_pdl[case]  # no early launch
        assert with_pdl[case]["waits_before_memory"], with_pdl[case]
        assert plain[case]["ACQBULK"] == plain[case]["PREEXIT"] == 0, plain[case]
