"""tools/sass_report.py on the FP4 GEMMs (sm_90 SASS, compiled on the CPU): properties the parity tests cannot see.

A synchronous global load inside a K loop costs a memory latency per K tile (v9 in docs/benchmarks.md: the scale
bytes, until their loads were written so that Triton pipelines them through cp.async).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import triton

TOOL = Path(__file__).resolve().parents[2] / "tools" / "sass_report.py"
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sass_report", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="triton's bundled ptxas / cuobjdump are needed to compile for sm_90")
@pytest.mark.parametrize("case", ["gate_up", "linear"])
def test_weight_gemm_k_loops_load_only_through_cp_async(case: str, tmp_path: Path) -> None:
    tool = _tool()
    fn, consts = tool.CASES[case]
    report = tool.sass_of(fn, {**consts, "WORDS": 1, "EVEN_K": 1}, 4, 3, tmp_path, case)
    assert report["loop_LDG"] == 0, report  # weights, scales and activations all arrive by cp.async
    assert report["loop_LDGSTS"] > 0 and report["HGMMA"] > 0, report  # pipelined loads, Hopper wgmma
    assert report["LDL"] == report["STL"] == 0, report  # no register spills
