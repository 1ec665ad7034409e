"""Run the decode step of tools/bench_rollout.py eagerly a few times, as a target for Nsight Compute.

Run: ncu --clock-control none -k regex:'_gate_up|_down_k|_attn_split|_linear_k' --launch-skip 8 --launch-count 8 \
         --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
         python tools/ncu_step.py --layers 2 --batch 64 --path fp4
ncu answers what graph-replay timings cannot: issue-slot use, stall reasons and achieved bandwidth per kernel.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from bench_rollout import Layer, Shape, bf16_layer, fill_caches, fp4_layer, step, step_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--path", choices=("fp4", "bf16"), default="fp4")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ncu_step needs a CUDA device")
    torch.manual_seed(0)
    s = Shape()
    layers = [Layer(s) for _ in range(args.layers)]
    caches16, caches4 = fill_caches(s, args.layers, args.batch, args.ctx)
    x, pos, cos, sin = step_inputs(s, args.batch, args.ctx)
    layer_fn, caches = (fp4_layer, caches4) if args.path == "fp4" else (bf16_layer, caches16)
    run = partial(step, partial(layer_fn, s), layers, caches, x, torch.empty_like(x), pos, cos, sin)
    for _ in range(args.steps):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
