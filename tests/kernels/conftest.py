"""Kernel tests run on CUDA when present, else on CPU through Triton's interpreter (tests/conftest.py turns it on
before anything imports Triton, and makes two of its roundings the hardware's, for every test directory)."""

import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
