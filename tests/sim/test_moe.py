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


def bf16_loop_reference(x: Tensor, w13, w2, ids: Tensor, weights: Tensor) -> Tensor:  # noqa: ANN001
    """A bf16 model forward's roundings, one token and slot at a time, sums in float64: weights to bf16, each
    GEMM output, silu(gate) and its product with up rounded to bf16; the slot sum rounded once at the end."""
    bf16, (N, k), I = torch.bfloat16, ids.shape, w2.shape[-1]
    out = torch.zeros(N, x.shape[1], dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            w13e, w2e = (expert_slice(w, int(ids[n, j])).dequantize().to(bf16).double() for w in (w13, w2))
            gate, up = (w13e @ x[n].double()).to(bf16).split(I)
            h = (F.silu(gate.float()).to(bf16).float() * up.float()).to(bf16)
            out[n] += weights[n, j].double() * (w2e @ h.double()).to(bf16).double()
    return out.to(bf16)


def test_fp4_moe_bf16_compute_rounds_where_a_bf16_forward_does() -> None:
    """Without the moe_down quantization, bit for bit with the per-token bf16 loop (fp32 against float64 sums
    could part at a bf16 rounding boundary; measured: never, on seeds 0-5). The fp32 path differs from it."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=gen).bfloat16()
    w13 = quantize_weight(torch.randn(4, 32, 32, generator=gen))
    w2 = quantize_weight(torch.randn(4, 32, 16, generator=gen))
    ids, weights = random_routing(5, 2, 4, gen)
    a, _ = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=False)
    b, _ = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=False, compute_dtype=torch.bfloat16)
    want = bf16_loop_reference(x, w13, w2, ids, weights)
    assert b.dtype == torch.bfloat16 and torch.equal(b, want) and not torch.equal(a, want)
