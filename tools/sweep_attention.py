"""FP4 decode attention launch-shape sweep (keys per iteration, warps, pipeline stages, programs per SM).

Run: python tools/sweep_attention.py [--wide | --defaults]   (CUDA only; graph-replayed median ms, bytes over 4.25 TB/s;
TRACE_LIGHTNING_KV_TILES=0 for a cache without value tiles)
The default shape is TRACE_LIGHTNING_ATTN_SHAPE (keys,warps,stages,programs-per-SM), see trace_lightning/kernels/kv.py.
"""

from __future__ import annotations

import itertools
import sys
from functools import partial

import torch
from _bench import COPY_CEILING, graph_ms
from bench_rollout import random_fp4_cache

from trace_lightning import kernels
from trace_lightning.kernels import kv as kv_kernels

SHAPES = ((64, 2048), (256, 2048), (250, 16896))  # (batch, context)
# (swap, keys, warps, stages, programs per SM): the keys-on-M form (the default) over the shapes that v6-v11 found
# best, one-warp shapes among them (no cross-warp step in the softmax reductions, more programs per SM; with the
# values in tiles a program holds 128 registers a thread instead of ~165, so more of them fit), and the q-side
# form's former default as the reference. --wide: the v11 grid (48 shapes).
VARIANTS = ([(True, 32, 1, 3, n) for n in (8, 12, 16)] + [(True, 64, 1, 3, n) for n in (8, 12)]
            + [(True, 64, 2, 3, n) for n in (4, 6, 8)] + [(True, 32, 2, 3, n) for n in (4, 8)]
            + [(False, 64, 2, 3, 4)])
WIDE = ([(True, *v) for v in itertools.product((32, 64, 128), (2, 4), (2, 3), (4, 6, 8))]
        + [(True, *v) for v in itertools.product((32, 64), (1,), (2, 3), (8, 12, 16))]
        + [(False, 64, 2, 3, 4)])


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_attention needs a CUDA device")
    variants = WIDE if "--wide" in sys.argv else VARIANTS
    if "--defaults" in sys.argv:  # the short and the long default shape only (before / after a kernel change)
        variants = [(True, 64, 2, 3, 4), (True, 32, 1, 3, 4)]
    Hq, Hkv, Dh = 32, 4, 128
    for B, ctx in SHAPES:
        S = ctx + 1
        layer = random_fp4_cache(B, Hkv, S, Dh)
        q = torch.randn(B, Hq, 1, Dh, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((B, 1), ctx, device="cuda", dtype=torch.int64)
        results = []
        for swap, bs, warps, stages, per_sm in variants:
            kv_kernels.ATTN_SWAP, kv_kernels.ATTN_BLOCK_S, kv_kernels.ATTN_WARPS = swap, bs, warps
            kv_kernels.ATTN_STAGES, kv_kernels.ATTN_PROGRAMS_PER_SM = stages, per_sm
            kv_kernels.ATTN_LONG_SHAPE = None  # this one shape at every size
            try:
                ms = graph_ms(partial(kernels.fp4_kv_attention, q, layer, pos, Dh**-0.5))
            except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                print(f"# B={B} ctx={ctx} swap {swap} {bs}/{warps}/{stages}/{per_sm}: {type(err).__name__}",
                      file=sys.stderr)
                continue
            results.append((ms, swap, bs, warps, stages, per_sm))
        results.sort()
        nbytes = layer.nbytes()

        def show(ms: float, nbytes: int = nbytes) -> str:
            return f"{ms * 1e3:.0f} us ({nbytes / (ms * 1e-3) / COPY_CEILING * 100:.0f}%)"

        keys_on_m = [r for r in results if r[1]]  # the shapes TRACE_LIGHTNING_ATTN_SHAPE can set (swap stays on)
        best = [f"{show(ms)} keys {bs} warps {w} stages {st} per-SM {ps}" for ms, _, bs, w, st, ps in keys_on_m[:4]]
        default = next((show(ms) for ms, *cfg in keys_on_m if tuple(cfg) == (True, 64, 2, 3, 4)), "n/a")
        q_side = next((show(ms) for ms, swap, *_ in results if not swap), "n/a")
        print(f"B={B} ctx={ctx}: q-side form {q_side}; default {default}; best " + "; ".join(best), flush=True)
        if keys_on_m:
            shape = ",".join(map(str, keys_on_m[0][2:]))
            print(f"BEST B={B} ctx={ctx} TRACE_LIGHTNING_ATTN_SHAPE={shape}", flush=True)


if __name__ == "__main__":
    main()
