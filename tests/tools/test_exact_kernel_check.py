"""tools/exact_kernel_check.py, the GPU diagnosis of the exact Triton kernels, under Triton's interpreter: every
comparison it prints finds 0 differing values where the kernels are right."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "exact_kernel_check.py"


def test_every_check_runs_and_agrees_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("exact_kernel_check", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    tool.main(["--device", "cpu"])
    out = capsys.readouterr().out
    counts = re.findall(r": (\d+)/(\d+) differ", out)
    # decoders 3, four GEMM shapes x (operands 5: codes and scales of each side, the globals; the reference on two
    # devices; two kernel launches) 32, one tree shape 1
    assert len(counts) == 36, out
    assert all(bad == "0" for bad, _ in counts), out
    assert "Error" not in out, out
