"""Shared test configuration: GPU tests skip cleanly without CUDA; sandbox tests need bubblewrap, except off CI.

The coding sandbox refuses to run without `bwrap` (by design: nothing weaker is a boundary), so its test files
cannot even be imported there. On a machine without it they are left out with a notice in the header; under CI
(CI=true, where .ci/run installs bubblewrap) nothing is left out, so a missing tool fails loudly.
"""

import os
from pathlib import Path

import pytest
import torch

from trace_lightning.envs.isolation import bwrap_problem

_SANDBOX_TESTS = ("security", "envs/test_coding.py")


def _sandbox_unavailable() -> str | None:
    return None if os.environ.get("CI") else bwrap_problem()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _sandbox_unavailable() and any(str(collection_path).endswith(p) for p in _SANDBOX_TESTS):
        return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    problem = _sandbox_unavailable()
    return None if problem is None else f"sandbox tests left out ({', '.join(_SANDBOX_TESTS)}): {problem}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
