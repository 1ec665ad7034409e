"""Does the FP4 GEMM's speed depend on the weights' codes? (bf16 subnormal operands in the packed dequant)."""
import os
from functools import partial

import torch
from _bench import bench_ms, graph_of

from trace_lightning import kernels
from trace_lightning.quant import NVFP4, tensor_global_scale


def no_half_codes(p: torch.Tensor) -> torch.Tensor:
    lo, hi = p & 15, p >> 4
    lo = torch.where((lo & 7) == 1, lo + 1, lo)
    hi = torch.where((hi & 7) == 1, hi + 1, hi)
    return (lo | (hi << 4)).to(torch.uint8)


torch.manual_seed(0)
E, D, I, k = 128, 2048, 768, 8
w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
q13 = kernels.quantize_nvfp4(w13, tensor_global_scale(w13, 2).unsqueeze(-1))
q2 = kernels.quantize_nvfp4(w2, tensor_global_scale(w2, 2).unsqueeze(-1))
frac = float(((q13.packed & 7) == 1).float().mean())
variants = {"random": (q13, q2),
            "no 0.5 codes": (NVFP4(no_half_codes(q13.packed), q13.scales, q13.global_scale),
                             NVFP4(no_half_codes(q2.packed), q2.scales, q2.global_scale))}
print(f"fast={os.environ.get('TRACE_LIGHTNING_FAST_DEQUANT', '1')} share of low nibbles with |code|=0.5: {frac:.3f}")
for N in (16, 64, 256):
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    gates, ids = torch.rand(N, E, device="cuda").softmax(-1).topk(k, dim=-1)
    gates = gates.bfloat16()
    for name, (a, b) in variants.items():
        g = graph_of(partial(kernels.fp4_moe, x, a, b, ids, gates))
        print(f"moe N={N} {name}: {bench_ms(g) * 1e3:.1f} us (graph)")
w = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
wq = kernels.quantize_nvfp4(w, tensor_global_scale(w, 2))
for M in (1, 64):
    x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
    for name, q in (("random", wq), ("no 0.5 codes", NVFP4(no_half_codes(wq.packed), wq.scales, wq.global_scale))):
        g = graph_of(partial(kernels.fp4_linear, x, q))
        print(f"linear M={M} {name}: {bench_ms(g) * 1e3:.1f} us (graph)")
