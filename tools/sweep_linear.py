"""FP4 linear launch-shape sweep at decode sizes: (block_n, block_k, split_k) against linear_config's choice.

Run: python tools/sweep_linear.py   (CUDA only; graph-replayed median us; shapes of qwen3-30b-a3b's wqkv and wo)
"""

from __future__ import annotations

import itertools
import sys
from functools import partial

import torch
from _bench import graph_ms

from trace_lightning import kernels
from trace_lightning.kernels.linear import linear, linear_config
from trace_lightning.quant import tensor_global_scale

VARIANTS = list(itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8)))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_linear needs a CUDA device")
    torch.manual_seed(0)
    for N, K, name in ((5120, 2048, "wqkv"), (2048, 4096, "wo")):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = kernels.prepare_weight(kernels.quantize_nvfp4(w, tensor_global_scale(w, 2)), w.dtype)
        for M in (16, 64, 256):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            bm, bn, bk, split = linear_config(M, N, K, x.device)
            base = graph_ms(partial(linear, x, wq, None)) * 1e3
            results = []
            for bn_, bk_, split_ in VARIANTS:
                try:
                    results.append((graph_ms(partial(linear, x, wq, None, split_, (bm, bn_, bk_))) * 1e3,
                                    (bn_, bk_, split_)))
                except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                    print(f"# {name} M={M} {bn_}/{bk_}/{split_}: {type(err).__name__}", file=sys.stderr)
            results.sort()
            best = "; ".join(f"{us:.1f} us {v}" for us, v in results[:4])
            print(f"{name} M={M}: default {base:.1f} us {(bn, bk, split)}; best {best}", flush=True)


if __name__ == "__main__":
    main()
