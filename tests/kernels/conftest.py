"""Kernel tests run on CUDA when present, else on CPU through Triton's interpreter.

Triton picks interpreter or compiler when a kernel is decorated (module import), reading TRITON_INTERPRET
then; so this sets it before trace_lightning.kernels is imported, and drops a copy some earlier test
imported without it.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    stale = [name for name in sys.modules if name.startswith("trace_lightning.kernels")]
    for name in stale:
        del sys.modules[name]
    if stale and "trace_lightning" in sys.modules and hasattr(sys.modules["trace_lightning"], "kernels"):
        delattr(sys.modules["trace_lightning"], "kernels")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
