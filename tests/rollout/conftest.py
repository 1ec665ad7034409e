"""Tiny debug-moe models for the engine tests (a fixed seed, so every test sees the same weights)."""

import copy

import pytest
import torch

from trace_lightning.model import Transformer


@pytest.fixture(scope="module")
def base_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer.from_name("debug-moe", n_layers=2, init_std=0.08)
    return model.eval()


@pytest.fixture
def model(base_model: Transformer) -> Transformer:
    """A fresh copy per test: the engine converts the model it is given in place."""
    return copy.deepcopy(base_model)


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 40, 41], [1, 70, 71]]
