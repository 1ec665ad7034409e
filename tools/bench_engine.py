"""CPU decode throughput of the embedded rollout engine on debug-moe, per precision, as a table.

Run: python tools/bench_engine.py --batch 8 --prompt-len 16 --new-tokens 64 --repeats 3
Tokens/s counts generated tokens over the decode loop only (prefill timed separately); every row runs
to max_new_tokens (no stop tokens). The FP4 rows go through the sim backend (the kernels' CPU twins),
which dequantizes weights on every call, so they measure the emulation, not FP4 kernels.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams

PRECISIONS: dict[str, FP4Precision | str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "nvfp4 W+A+KV (fp32 compute)": FP4Precision(compute_dtype="fp32"),
    "nvfp4 W+A+KV (bf16 compute)": FP4Precision(compute_dtype="bf16"),
    "nvfp4 W+A+KV bf16 + capture": FP4Precision(compute_dtype="bf16"),
    "mxfp4 W+A+KV (bf16 compute)": FP4Precision(fmt="mxfp4", compute_dtype="bf16"),
}


def bench(model: Transformer, precision: FP4Precision | str, prompts: list[list[int]], params: SamplingParams,
          repeats: int, capture: CaptureSpec | None) -> tuple[float, float]:
    """Best-of-repeats (decode tokens/s, prefill ms)."""
    engine = Engine(copy.deepcopy(model), precision, backend="sim")
    engine.generate(prompts, SamplingParams(max_new_tokens=2), capture=capture)  # warm-up
    best_tps, best_prefill = 0.0, float("inf")
    for _ in range(repeats):
        out = engine.generate(prompts, params, capture=capture)
        decoded = out.stats["new_tokens"] - len(prompts)  # the first token of each row comes from prefill
        best_tps = max(best_tps, decoded / out.stats["decode_s"])
        best_prefill = min(best_prefill, 1000 * out.stats["prefill_s"])
    return best_tps, best_prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer.from_name("debug-moe").eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    print(f"debug-moe, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'precision':<30} {'decode tok/s':>12} {'prefill ms':>11}")
    for name, precision in PRECISIONS.items():
        capture = CaptureSpec() if "capture" in name else None
        tps, prefill = bench(model, precision, prompts, params, args.repeats, capture)
        print(f"{name:<30} {tps:>12.0f} {prefill:>11.1f}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
