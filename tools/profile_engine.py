"""Where the rollout engine's decode step spends GPU time (torch.profiler), next to tools/profile_step.py's model.

Run: python tools/profile_engine.py --layers 4 --batch 64 --prompt-len 256   (CUDA only)
     python tools/profile_engine.py --preset medium-moe --layers 0 --batch 256 --prompt-len 536  (the long fit's decode)
The engine runs eagerly here (kernel times do not depend on graph replay); the step's kernels are the
difference between a generate call of 1 + N new tokens and one of 1, over N. Same qwen3-30b-a3b layer shape
and random weights as tools/bench_hf_peer.py, so its per-layer time can be set against the synthetic step.
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from functools import partial

import torch
from profile_step import kernel_times

from trace_lightning.model import Transformer
from trace_lightning.rollout import Engine, FP4Precision, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (random weights)")
    parser.add_argument("--layers", type=int, default=4, help="override the preset's layer count (0: keep)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_engine needs a CUDA device")
    torch.manual_seed(0)
    layers = {"n_layers": args.layers} if args.layers else {}
    model = Transformer.from_name(args.preset, **layers, init_std=0.02,
                                  max_seq_len=args.prompt_len + args.steps + 8).to(torch.bfloat16).cuda()
    rows = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len)).tolist()
    for name, precision in (("bf16", "bf16"), ("fp4", FP4Precision(compute_dtype=torch.bfloat16))):
        engine = Engine(copy.deepcopy(model), precision, cuda_graph=False)

        def gen(n: int, engine: Engine = engine) -> None:
            engine.generate(rows, SamplingParams(max_new_tokens=n, temperature=0.0))

        long, _ = kernel_times(partial(gen, 1 + args.steps), reps=2)
        short, _ = kernel_times(partial(gen, 1), reps=2)
        step = collections.Counter({k: (long[k] - short[k]) / args.steps for k in long})
        total = sum(v for v in step.values() if v > 0)
        print(f"\n## engine {name} batch {args.batch}: {total:.0f} us of kernels per decode step, "
              f"{total / model.config.n_layers:.1f} per layer incl. lm_head and sampling ({len(step)} kernel names)")
        print("| kernel | us/step | share |\n|---|---|---|")
        for kname, us in step.most_common(args.top):
            print(f"| {kname} | {us:.1f} | {us / total * 100:.1f}% |")


if __name__ == "__main__":
    main()
