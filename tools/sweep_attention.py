"""FP4 decode attention launch-shape sweep (keys per iteration, warps, pipeline stages, programs per SM).

Run: python tools/sweep_attention.py [--wide | --defaults]   (CUDA only; graph-replayed median ms, bytes over 4.25 TB/s)
Each shape runs at every length (KernelOptions with no long shape); the kernels' defaults are KernelOptions'
`attention` (programs streaming fewer than 2K keys) and `attention_long` (kernels/_common.py). A BEST line's shape
goes to bench_rollout.py --attention-shape.
"""

from __future__ import annotations

import itertools
import sys
from functools import partial

import torch
from _bench import COPY_CEILING, graph_ms
from bench_rollout import random_fp4_cache

from trace_lightning import kernels

SHAPES = ((64, 2048), (256, 2048), (250, 16896))  # (batch, context)
# (keys, warps, stages, programs per SM): the shapes that v6-v11 found best, one-warp shapes among them (no cross-warp
# step in the softmax reductions, more programs per SM; with the values in tiles a program holds 128 registers a
# thread instead of ~165, so more of them fit). --wide: the v11 grid (48 shapes).
VARIANTS = ([(32, 1, 3, n) for n in (8, 12, 16)] + [(64, 1, 3, n) for n in (8, 12)]
            + [(64, 2, 3, n) for n in (4, 6, 8)] + [(32, 2, 3, n) for n in (4, 8)])
WIDE = ([*itertools.product((32, 64, 128), (2, 4), (2, 3), (4, 6, 8))]
        + [*itertools.product((32, 64), (1,), (2, 3), (8, 12, 16))])


def one_shape(keys: int, warps: int, stages: int, per_sm: int) -> kernels.KernelOptions:
    """KernelOptions that launch the attention with this shape at every length."""
    return kernels.KernelOptions(attention=kernels.AttentionLaunch(keys, warps, stages), attention_long=None,
                                 attention_programs_per_sm=per_sm)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_attention needs a CUDA device")
    variants = WIDE if "--wide" in sys.argv else VARIANTS
    default = kernels.KernelOptions()
    short = (default.attention.keys, default.attention.warps, default.attention.stages,
             default.attention_programs_per_sm)
    if "--defaults" in sys.argv:  # the short and the long default shape only (before / after a kernel change)
        long = default.attention_long
        variants = [short, (long.keys, long.warps, long.stages, default.attention_programs_per_sm)]
    Hq, Hkv, Dh = 32, 4, 128
    for B, ctx in SHAPES:
        S = ctx + 1
        layer = random_fp4_cache(B, Hkv, S, Dh)
        q = torch.randn(B, Hq, 1, Dh, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((B, 1), ctx, device="cuda", dtype=torch.int64)
        results = []
        for shape in variants:
            try:
                with kernels.kernel_options(one_shape(*shape)):
                    ms = graph_ms(partial(kernels.fp4_kv_attention, q, layer, pos, Dh**-0.5))
            except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                print(f"# B={B} ctx={ctx} {'/'.join(map(str, shape))}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((ms, shape))
        results.sort()
        nbytes = layer.nbytes()

        def show(ms: float, nbytes: int = nbytes) -> str:
            return f"{ms * 1e3:.0f} us ({nbytes / (ms * 1e-3) / COPY_CEILING * 100:.0f}%)"

        best = [f"{show(ms)} keys {bs} warps {w} stages {st} per-SM {ps}" for ms, (bs, w, st, ps) in results[:4]]
        at_default = next((show(ms) for ms, shape in results if shape == short), "n/a")
        print(f"B={B} ctx={ctx}: short default {at_default}; best " + "; ".join(best), flush=True)
        if results:
            print(f"BEST B={B} ctx={ctx} --attention-shape {','.join(map(str, results[0][1]))}", flush=True)


if __name__ == "__main__":
    main()
