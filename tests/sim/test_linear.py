"""sim fp4_linear against dequantize + float64 matmul."""

import pytest
import torch

from trace_lightning import sim
from trace_lightning.quant import quantize_nvfp4
from trace_lightning.sim.testing import quantize_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_linear_matches_dequant_matmul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 96, generator=gen).to(dtype), quantize_weight(torch.randn(40, 96, generator=gen))
    ref = x.double() @ w.dequantize().double().T
    out = sim.fp4_linear(x, w)
    assert out.dtype == dtype and out.shape == (7, 40)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert sim.fp4_linear(x, w, out_dtype=torch.float32).dtype == torch.float32


def test_fp4_linear_global_shapes_and_bf16_compute() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    for g in (None, torch.tensor(0.01), torch.full((16, 1), 0.01)):
        q = quantize_nvfp4(w, g)
        torch.testing.assert_close(sim.fp4_linear(x, q), x @ q.dequantize().T, rtol=1e-5, atol=1e-5)
    q = quantize_weight(w)
    bf = sim.fp4_linear(x, q, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(bf, x @ q.dequantize().T, rtol=2e-2, atol=5e-2)


def test_fp4_linear_rejects_mismatch() -> None:
    with pytest.raises(ValueError):
        sim.fp4_linear(torch.randn(2, 32), quantize_weight(torch.randn(8, 48)))
