"""CPU decode throughput of the embedded rollout engine on debug-moe, per precision, as a table.

Run: python tools/bench_engine.py --batch 8 --prompt-len 16 --new-tokens 64 --repeats 3
Tokens/s counts generated tokens over the decode loop only (prefill timed separately); every row runs
to max_new_tokens (no stop tokens). The FP4 rows go through the sim backend (the kernels' CPU twins),
which dequantizes weights on every call, so they measure the emulation, not FP4 kernels.

With --long-tail SLOTS the --batch prompts get long-tailed response lengths (max_new_tokens per prompt drawn
log-normal with a fixed seed, median --new-tokens / 8, capped at --new-tokens) and the table compares static
batching (the prompts in batches of SLOTS, one generate call each) with continuous batching
(generate(max_batch=SLOTS)): generated tokens/s over the whole calls, prefills included, and decode steps.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams, sequence_seeds

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


def long_tail_lengths(n: int, cap: int, sigma: float = 1.0) -> list[int]:
    """n response lengths, log-normal (median cap / 8, fixed seed) and clipped to [1, cap]: a few long, many short."""
    g = torch.Generator().manual_seed(1)
    draws = torch.exp(torch.randn(n, generator=g) * sigma) * cap / 8
    return draws.round().clamp(1, cap).long().tolist()


def bench_long_tail(model: Transformer, precision: FP4Precision | str, prompts: list[list[int]], lengths: list[int],
                    slots: int, repeats: int) -> tuple[dict[str, tuple[float, float]], int]:
    """Best-of-repeats {"static" | "continuous": (generated tokens/s over the calls, decode steps)}, and how many
    sequences came out token for token the same both ways (all in fp32; in bf16 the eager loop's attention
    window, which depends on the batch, can move a logit by an ulp and, through FP4 activations, a token)."""
    engine = Engine(copy.deepcopy(model), precision, backend="sim")
    engine.generate(prompts[:slots], SamplingParams(max_new_tokens=2))  # warm-up
    seeds = sequence_seeds(0, len(prompts))
    chunks = [slice(i, i + slots) for i in range(0, len(prompts), slots)]

    def static() -> list[RolloutBatch]:
        return [engine.generate(prompts[c], SamplingParams(max_new_tokens=lengths[c], seed=seeds[c])) for c in chunks]

    def continuous() -> list[RolloutBatch]:
        return [engine.generate(prompts, SamplingParams(max_new_tokens=lengths, seed=seeds), max_batch=slots)]

    best: dict[str, tuple[float, float]] = {}
    responses: dict[str, list[list[int]]] = {}
    for name, run in (("static", static), ("continuous", continuous)):
        for _ in range(repeats):
            start = time.perf_counter()
            outs = run()
            elapsed = time.perf_counter() - start
            tps = sum(o.stats["new_tokens"] for o in outs) / elapsed
            best[name] = max(best.get(name, (0.0, 0.0)), (tps, sum(o.stats["decode_steps"] for o in outs)))
        responses[name] = [r for o in outs for r in o.responses]
    return best, sum(a == b for a, b in zip(responses["static"], responses["continuous"], strict=True))


def main_long_tail(model: Transformer, prompts: list[list[int]], args: argparse.Namespace) -> None:
    lengths = long_tail_lengths(len(prompts), args.new_tokens)
    print(f"response lengths: {sum(lengths)} tokens, median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}; "
          f"{args.long_tail} slots")
    print(f"{'precision':<30} {'static tok/s':>12} {'steps':>6} {'continuous tok/s':>16} {'steps':>6} {'speedup':>8} "
          f"{'same tokens':>11}")
    for name in args.precision or ["fp32"]:
        r, same = bench_long_tail(model, PRECISIONS[name], prompts, lengths, args.long_tail, args.repeats)
        (s_tps, s_steps), (c_tps, c_steps) = r["static"], r["continuous"]
        print(f"{name:<30} {s_tps:>12.0f} {s_steps:>6.0f} {c_tps:>16.0f} {c_steps:>6.0f} {c_tps / s_tps:>7.2f}x "
              f"{same:>5}/{len(prompts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--long-tail", type=int, default=0, metavar="SLOTS",
                        help="static vs continuous batching in SLOTS slots on long-tailed response lengths")
    parser.add_argument("--precision", action="append", choices=list(PRECISIONS),
                        help="with --long-tail: the precisions to run (repeatable; default fp32)")
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
    if args.long_tail:
        main_long_tail(model, prompts, args)
        return
    print(f"{'precision':<30} {'decode tok/s':>12} {'prefill ms':>11}")
    for name, precision in PRECISIONS.items():
        capture = CaptureSpec() if "capture" in name else None
        tps, prefill = bench(model, precision, prompts, params, args.repeats, capture)
        print(f"{name:<30} {tps:>12.0f} {prefill:>11.1f}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
