"""sim fp4_moe against a plain per-token, per-slot loop over dequantized experts."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from trace_lightning import sim
from trace_lightning.quant import quantize_nvfp4, row_global_scale
from trace_lightning.sim.testing import expert_slice, quantize_weight, random_routing


def loop_reference(x, w13, w2, ids, weights, quantize_h):  # noqa: ANN001, ANN201
    N, k = ids.shape
    I = w2.shape[-1]
    h = torch.zeros(N, k, I)
    for n in range(N):
        for j in range(k):
            gate, up = (expert_slice(w13, int(ids[n, j])).dequantize() @ x[n].float()).split(I)
            h[n, j] = F.silu(gate) * up
    q = quantize_nvfp4(h, row_global_scale(h)) if quantize_h else None
    hd = q.dequantize() if quantize_h else h
    out = torch.zeros(N, x.shape[1])
    for n in range(N):
        for j in range(k):
            out[n] += weights[n, j].float() * (expert_slice(w2, int(ids[n, j])).dequantize() @ hd[n, j])
    return out, q


@pytest.mark.parametrize("quantize_h", [True, False])
def test_fp4_moe_matches_loop(quantize_h: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    N, D, I, E, k = 9, 64, 32, 6, 2
    x = torch.randn(N, D, generator=gen)
    w13 = quantize_weight(torch.randn(E, 2 * I, D, generator=gen) / 8)
    w2 = quantize_weight(torch.randn(E, D, I, generator=gen) / 8)
    ids, weights = random_routing(N, k, E, gen)
    out, q = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=quantize_h)
    ref, q_ref = loop_reference(x, w13, w2, ids, weights, quantize_h)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if quantize_h:
        assert q.shape == (N, k, I)
        # h differs from the loop's by float32 summation order, so row globals may differ in the last ulp
        assert (q.codes() == q_ref.codes()).float().mean() > 0.99
        torch.testing.assert_close(q.dequantize(), q_ref.dequantize(), rtol=1e-5, atol=1e-5)
    else:
        assert q is None


def test_fp4_moe_untouched_experts_are_ignored() -> None:
    gen = torch.Generator().manual_seed(1)
    N, D, I, E = 4, 32, 16, 8
    x = torch.randn(N, D, generator=gen)
    w13 = quantize_weight(torch.randn(E, 2 * I, D, generator=gen))
    w2 = quantize_weight(torch.randn(E, D, I, generator=gen))
    ids = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 0]])
    weights = torch.rand(N, 2, generator=gen)
    out, _ = sim.fp4_moe(x, w13, w2, ids, weights)
    w13.scales.view(torch.uint8)[5] = 0x7F  # poison an expert no token uses: NaN if it were read
    out2, _ = sim.fp4_moe(x, w13, w2, ids, weights)
    assert torch.equal(out, out2)


U_BF16 = 2.0**-8  # bf16 unit roundoff
SILU_LIPSCHITZ = 1.0998  # max |silu'(x)|


def bf16_moe_error_bound(x: Tensor, w13, w2, ids: Tensor, weights: Tensor) -> Tensor:  # noqa: ANN001
    """Per-element bound on |fp32-compute - bf16-compute| of fp4_moe without the moe_down quantization, from
    the bf16 roundings the bf16 path makes (weights to bf16, each GEMM output, silu, the product; fp32
    accumulation adds K * 2^-24), first order plus the cross terms, on float64 magnitudes."""
    u, N, k = U_BF16, *ids.shape
    I, D = w2.shape[-1], x.shape[-1]
    bound = torch.zeros(N, D, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            w13e = expert_slice(w13, int(ids[n, j])).dequantize().double()  # (2I, D)
            w2e = expert_slice(w2, int(ids[n, j])).dequantize().double().abs()  # (D, I)
            xd = x[n].double()
            gate, up = (w13e @ xd).split(I)
            mag = (w13e.abs() @ xd.abs()).split(I)
            eg, eu = ((2 * u + D * 2.0**-24) * m for m in mag)  # weight rounding, output rounding, accumulation
            s = F.silu(gate)
            es = SILU_LIPSCHITZ * eg + u * (s.abs() + SILU_LIPSCHITZ * eg)  # silu of a perturbed gate, rounded
            h = (s * up).abs()
            eh = es * (up.abs() + eu) + s.abs() * eu + u * (h + es * (up.abs() + eu) + s.abs() * eu)
            ey = w2e @ eh + (2 * u + I * 2.0**-24) * (w2e @ (h + eh))
            bound[n] += weights[n, j].double() * ey
    return bound


def test_fp4_moe_bf16_compute_is_within_its_rounding_bound() -> None:
    """Without the moe_down quantization (which a half-ulp difference can move by a whole FP4 step), the bf16
    path differs from the fp32 path by at most the propagated bf16 roundings, plus each output's bf16 cast."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=gen).bfloat16()
    w13 = quantize_weight(torch.randn(4, 32, 32, generator=gen))
    w2 = quantize_weight(torch.randn(4, 32, 16, generator=gen))
    ids, weights = random_routing(5, 2, 4, gen)
    a, _ = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=False)
    b, _ = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=False, compute_dtype=torch.bfloat16)
    assert a.dtype == b.dtype == torch.bfloat16
    difference = (a.double() - b.double()).abs()
    bound = bf16_moe_error_bound(x, w13, w2, ids, weights) + U_BF16 * (a.double().abs() + b.double().abs())
    assert difference.max() > 0 and (difference <= bound).all(), float((difference / bound).max())
