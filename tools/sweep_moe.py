"""Fused FP4 MoE launch sweep: gate/up and down (block_n, K tile, warps, stages), and the alignment alone.

Run: python tools/sweep_moe.py [--align-only] [--gemms down] [--batches 16 64]
(CUDA only; graph-replayed median us of the whole fp4_moe call at decode sizes)
Each GEMM is varied with the other at its default (they run one after the other, so their times add), through
KernelOptions.moe_gate_up / moe_down (kernels/_common.py; their defaults keep moe.py's choices by size).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial

import torch
from _bench import graph_ms

from trace_lightning import kernels
from trace_lightning.kernels import moe as moe_kernels
from trace_lightning.quant import tensor_global_scale

BATCHES = (16, 64, 256)
GATE_UP = [*itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3,)), (64, 64, 4, 2), (64, 64, 4, 4)]
# down: (block_n, block_k, warps, stages); block_k None keeps block_k_for's K tile (128 for 16-row tiles)
DOWN = [*itertools.product((32, 64, 128), (None,), (4, 8), (3,)), (64, None, 4, 2), (64, None, 4, 4),
        *itertools.product((64, 128), (256,), (4, 8), (2, 3))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--align-only", action="store_true", help="time only the alignment")
    parser.add_argument("--gemms", nargs="*", default=["gate_up", "down"], choices=["gate_up", "down"])
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_moe needs a CUDA device")
    torch.manual_seed(0)
    E, D, I, k = 128, 2048, 768, 8
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    q13 = kernels.prepare_weight(kernels.quantize_nvfp4(w13, tensor_global_scale(w13, 2).unsqueeze(-1)), w13.dtype)
    q2 = kernels.prepare_weight(kernels.quantize_nvfp4(w2, tensor_global_scale(w2, 2).unsqueeze(-1)), w2.dtype)
    for N in args.batches:
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        gates, ids = torch.rand(N, E, device="cuda").softmax(-1).topk(k, dim=-1)
        gates = (gates / gates.sum(-1, keepdim=True)).bfloat16()
        call = partial(kernels.fp4_moe, x, q13, q2, ids, gates)
        base = graph_ms(call) * 1e3
        print(f"N={N} fp4_moe default: {base:.0f} us", flush=True)
        sweeps = [(name, GATE_UP if name == "gate_up" else DOWN) for name in args.gemms]
        for name, variants in () if args.align_only else sweeps:
            results = []
            for v in variants:
                options = kernels.KernelOptions(**{f"moe_{name}": kernels.GemmLaunch(*v)})
                try:
                    with kernels.kernel_options(options):
                        results.append((graph_ms(call) * 1e3, v))
                except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                    print(f"# N={N} {name} {v}: {type(err).__name__}", file=sys.stderr)
            results.sort()
            best = "; ".join(f"{us:.0f} us {v}" for us, v in results[:4])
            print(f"N={N} {name}: default {base:.0f} us; best {best}", flush=True)
        block_m = moe_kernels.moe_config(N * k, E, I, x.device)[0]
        align = graph_ms(partial(moe_kernels.align_pairs, ids, E, block_m)) * 1e3
        print(f"N={N} align_pairs: {align:.1f} us", flush=True)


if __name__ == "__main__":
    main()
