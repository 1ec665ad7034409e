"""The dispatch point: which backend serves which device."""

import pytest
import torch

from trace_lightning import ops, sim
from trace_lightning.ops import FP4KVLayer, backend_for


def test_auto_is_sim_on_cpu_and_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_for("cpu") is sim and backend_for(torch.device("cpu"), "sim") is sim
    assert not ops.is_triton(sim)
    with pytest.raises(ValueError, match="unknown backend"):
        backend_for("cpu", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend_for("cpu", "triton")


def test_kv_layer_allocate() -> None:
    layer = FP4KVLayer.allocate(2, 4, 16, 64)
    assert layer.shape == (2, 4, 16, 64) and layer.k_scales.dtype == torch.float8_e4m3fn
    assert layer.k_global.shape == (2, 4, 16, 1) and layer.nbytes() == 2 * 2 * 4 * 16 * (32 + 4 + 4)
    assert layer.dequantize_v().eq(0).all() and ops.FP4KVLayer is FP4KVLayer
