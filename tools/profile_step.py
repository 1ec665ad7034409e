"""Where a decode step's GPU time goes: per-kernel CUDA time of the BF16 and FP4 steps (torch.profiler).

Run: python tools/profile_step.py --layers 4 --batch 64 --ctx 2048   (CUDA only)
Same layers and paths as tools/bench_rollout.py, run eagerly (kernel times do not depend on graph capture;
launch gaps do, and are what the graph-replayed step time in bench_rollout adds on top).
"""

from __future__ import annotations

import argparse
import collections
import sys
from functools import partial

import torch
from bench_rollout import Layer, Shape, bf16_layer, fill_caches, fp4_layer, step, step_inputs
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn, reps: int = 5) -> tuple[collections.Counter, float]:  # noqa: ANN001
    """(microseconds per step by kernel name, total kernel microseconds per step)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: collections.Counter = collections.Counter()
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            times[evt.key[:70]] += evt.device_time_total / reps
    return times, sum(times.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step needs a CUDA device")
    torch.manual_seed(0)
    s = Shape()
    layers = [Layer(s) for _ in range(args.layers)]
    for B in args.batch:
        caches16, caches4 = fill_caches(s, args.layers, B, args.ctx)
        x, pos, cos, sin = step_inputs(s, B, args.ctx)
        out = torch.empty_like(x)
        for name, layer_fn, caches in (("bf16", bf16_layer, caches16), ("fp4", fp4_layer, caches4)):
            times, total = kernel_times(partial(step, partial(layer_fn, s), layers, caches, x, out, pos, cos, sin))
            print(f"\n## {name} batch {B}: {total / args.layers:.1f} us of kernels per layer "
                  f"({len(times)} kernel names)")
            print("| kernel | us/layer | share |\n|---|---|---|")
            for kname, us in times.most_common(args.top):
                print(f"| {kname} | {us / args.layers:.1f} | {us / total * 100:.1f}% |")
        del caches16, caches4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
