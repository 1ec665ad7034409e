"""tools/exact_kernel_check.py, the GPU diagnosis of the exact Triton kernels, under Triton's interpreter: every
comparison it prints finds 0 differing values where the kernels are right."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "exact_kernel_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("exact_kernel_check", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    return tool


def test_every_check_runs_and_agrees_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _load()
    assert tool.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    counts = re.findall(r": (\d+)/(\d+) differ", out)
    # decoders 3, four GEMM shapes x (operands 5: codes and scales of each side, the globals; the reference on two
    # devices; two kernel launches) 32, one tree shape 1
    assert len(counts) == 36, out
    assert all(bad == "0" for bad, _ in counts), out
    assert "Error" not in out, out
    assert "verdict: the exact kernels agree with the reference (0 values differ)" in out, out


def test_a_wrong_kernel_fails_the_verdict(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The exit status is what a GPU call chains on: a kernel off by one ulp anywhere makes it 1."""
    tool = _load()
    right = tool.ke.exact_fp4_gemm

    def off_by_one_ulp(*args: object, **kwargs: object) -> torch.Tensor:
        out = right(*args, **kwargs)
        out.view(torch.int32)[0, 0] += 1
        return out

    monkeypatch.setattr(tool.ke, "exact_fp4_gemm", off_by_one_ulp)
    monkeypatch.setattr(tool, "tree_times", lambda device: 0)  # the GEMMs decide here
    assert tool.main(["--device", "cpu"]) == 1
    # one wrong value in each of the four shapes' default launch (the float32 "ieee" launch informs, it does not count)
    assert "verdict: FAILED (4 values differ)" in capsys.readouterr().out
