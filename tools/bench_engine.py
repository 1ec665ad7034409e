"""Throughput of the real rollout engine end to end (prefill included, records on where asked), per precision.

Run: python tools/bench_engine.py --batch 8 --prompt-len 16 --new-tokens 64 --repeats 3
     python tools/bench_engine.py --preset small-moe --device cuda --batch 512 --prompt-len 24 --new-tokens 128
     python tools/bench_engine.py --preset qwen3-30b-a3b --device cuda --batch 0 --prompt-len 512 --new-tokens 16384 \
         --records-to-host        # 16K rollouts, each engine at its own largest batch
Every row runs to max_new_tokens (no stop tokens); on CUDA each row also shows the device's peak memory beside the
engine's memory plan (weights, KV cache, records, routes, and the measured workspace of its largest forward: the
target is <= 1.15x plus a fixed amount). "tok/s"
counts generated tokens over the whole generate call, prefill included (the device synchronized before the clock
stops); "decode tok/s" the decode loop's alone (on a GPU the prefill's tail spills into it: the loop's first host
check is where the device catches up). On the CPU the FP4 rows run the sim backend (the kernels' CPU twins, which
dequantize weights on every call: they measure the emulation, not FP4 kernels); on CUDA the Triton kernels with
CUDA graphs.

With --long-tail SLOTS the --batch prompts get long-tailed response lengths (max_new_tokens per prompt drawn
log-normal with a fixed seed, median --new-tokens / 8, capped at --new-tokens) and the table compares static
batching (the prompts in batches of SLOTS, one generate call each) with continuous batching
(generate(max_batch=SLOTS)): generated tokens/s over the whole calls, prefills included, decode steps, and the
seconds spent prefilling (the refills', under continuous batching: where a continuous step's extra time goes).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from _bench import copy_bandwidth
from _peak import peak_blocks

from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams, sequence_seeds

PRECISIONS: dict[str, FP4Precision | str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "nvfp4 W+A+KV (fp32 compute)": FP4Precision(compute_dtype="fp32"),
    "nvfp4 W+A+KV (bf16 compute)": FP4Precision(compute_dtype="bf16"),
    "nvfp4 W+A+KV bf16 + capture": FP4Precision(compute_dtype="bf16"),
    "nvfp4 W+A+KV bf16 + parity records": FP4Precision(compute_dtype="bf16"),
    "mxfp4 W+A+KV (bf16 compute)": FP4Precision(fmt="mxfp4", compute_dtype="bf16"),
}
CAPTURES = {"nvfp4 W+A+KV bf16 + capture": CaptureSpec(),
            "nvfp4 W+A+KV bf16 + parity records": CaptureSpec(mode="parity")}
"""The rows that record: full codes of every layer and site, or parity bits (what trace_compact keeps)."""
ON_GPU = ("bf16", "nvfp4 W+A+KV (bf16 compute)", "nvfp4 W+A+KV bf16 + parity records", "nvfp4 W+A+KV bf16 + capture")
"""The rows a CUDA run shows by default."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def largest_batch(engine: Engine, max_len: int, prompt_len: int, capture: CaptureSpec | None,
                  reserve_gib: float) -> int:
    """The engine's own largest batch (Engine.max_batch, its measured workspace counted) in the device's free memory
    less reserve_gib."""
    free = torch.cuda.mem_get_info()[0] if engine.device.type == "cuda" else 64 << 30
    return engine.max_batch(max_len, free + engine.weight_bytes(), capture=capture,
                            reserve_bytes=int(reserve_gib * 2**30), prompt_len=prompt_len, workspace=True)


def model_factory(preset: str, device: str, **overrides: object) -> Callable[[], Transformer]:
    """A fresh copy of one random model (seed 0) for each engine. On the CPU a deep copy of an fp32 model; on CUDA
    built in bf16 on the device from the seed each time: qwen3-30b-a3b is 61 GB in bf16, so an fp32 model, or a
    source model beside each engine's copy, would not fit."""
    if not device.startswith("cuda"):
        torch.manual_seed(0)
        model = Transformer.from_name(preset, **overrides).to(device).eval()
        return lambda: copy.deepcopy(model)

    def build() -> Transformer:
        torch.cuda.empty_cache()  # the previous engine's blocks
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                return Transformer.from_name(preset, **overrides).eval()
        finally:
            torch.set_default_dtype(default)

    return build


def bench(make_model: Callable[[], Transformer], precision: FP4Precision | str, batch: int, prompt_len: int,
          params: SamplingParams, repeats: int, capture: CaptureSpec | None, backend: str = "auto",
          prefill_dense_from: int | None = None, reserve_gib: float = 2.0,
          prefill_chunk: int | None = None, peak_sites: int = 0) -> dict[str, Any]:
    """Best-of-repeats tokens/s of the whole call, decode-loop tokens/s and prefill ms, at `batch` (0: the engine's
    largest), with the device's peak memory against the engine's memory plan; with `peak_sites` (CUDA), one more call
    with its decode session allocated anew, recorded by the allocator, and the sites holding the most at its peak."""
    engine = Engine(make_model(), precision, backend=backend, prefill_dense_from=prefill_dense_from,
                    prefill_chunk=prefill_chunk)
    device = engine.device
    max_len = prompt_len + int(params.max_new_tokens)  # type: ignore[arg-type]
    batch = batch or largest_batch(engine, max_len, prompt_len, capture, reserve_gib)
    prompts = random_prompts(batch, prompt_len, engine.config.vocab_size)
    engine.generate(prompts, SamplingParams(max_new_tokens=8), capture=capture)  # warm-up: compile, autotune
    best = {"batch": float(batch), "tok/s": 0.0, "decode tok/s": 0.0, "prefill ms": float("inf"),
            "ms/step": float("inf")}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params, capture=capture)
        synchronize(device)
        elapsed = time.perf_counter() - start
        decoded = out.stats["new_tokens"] - len(prompts)  # the first token of each row comes from prefill
        best["tok/s"] = max(best["tok/s"], out.stats["new_tokens"] / elapsed)
        best["decode tok/s"] = max(best["decode tok/s"], decoded / out.stats["decode_s"])
        best["prefill ms"] = min(best["prefill ms"], 1000 * out.stats["prefill_s"])
        best["ms/step"] = min(best["ms/step"], 1000 * out.stats["decode_s"] / max(out.stats["decode_steps"], 1))
        del out
    best["peak GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    plan = engine.memory_plan(batch, max_len, capture, prompt_len=prompt_len, workspace=True)  # measures: after peak
    best["plan GiB"], best["workspace GiB"] = plan.total / 2**30, plan.workspace / 2**30
    # the bytes an average decode step must move (weights touched, KV at the mean context, records written)
    best["MB/step"] = engine.decode_step_traffic(batch, max_len - params.max_new_tokens / 2, capture).total / 1e6
    if peak_sites and device.type == "cuda":
        engine.release_decode_session()  # the recorded call allocates its session, as a first call does
        peak, sites = peak_blocks(lambda: engine.generate(prompts, params, capture=capture), device)
        best["peak sites"] = [f"at the peak of a call, {peak / 2**30:.2f} GiB above what was held before it (plan "
                              f"{best['plan GiB']:.2f} GiB with the weights), by allocation site:"]
        best["peak sites"] += [f"    {n / 2**30:8.3f} GiB in {blocks:5d} blocks  {site}"
                               for n, blocks, site in sites[:peak_sites]]
    return best


def long_tail_lengths(n: int, cap: int, sigma: float = 1.0) -> list[int]:
    """n response lengths, log-normal (median cap / 8, fixed seed) and clipped to [1, cap]: a few long, many short."""
    g = torch.Generator().manual_seed(1)
    draws = torch.exp(torch.randn(n, generator=g) * sigma) * cap / 8
    return draws.round().clamp(1, cap).long().tolist()


def bench_long_tail(make_model: Callable[[], Transformer], precision: FP4Precision | str, prompts: list[list[int]],
                    lengths: list[int], slots: int, repeats: int,
                    backend: str = "auto") -> tuple[dict[str, tuple[float, float, float]], int]:
    """Best-of-repeats {"static" | "continuous": (generated tokens/s over the calls, decode steps, seconds of
    prefill: the prompts', or the refills' under continuous batching)}, and how many
    sequences came out token for token the same both ways (all in fp32; in bf16 the eager loop's attention
    window, which depends on the batch, can move a logit by an ulp and, through FP4 activations, a token)."""
    engine = Engine(make_model(), precision, backend=backend)
    engine.generate(prompts[:slots], SamplingParams(max_new_tokens=2))  # warm-up
    seeds = sequence_seeds(0, len(prompts))
    chunks = [slice(i, i + slots) for i in range(0, len(prompts), slots)]

    def static() -> list[RolloutBatch]:
        return [engine.generate(prompts[c], SamplingParams(max_new_tokens=lengths[c], seed=seeds[c])) for c in chunks]

    def continuous() -> list[RolloutBatch]:
        return [engine.generate(prompts, SamplingParams(max_new_tokens=lengths, seed=seeds), max_batch=slots)]

    best: dict[str, tuple[float, float, float]] = {}
    responses: dict[str, list[list[int]]] = {}
    for name, run in (("static", static), ("continuous", continuous)):
        for _ in range(repeats):
            start = time.perf_counter()
            outs = run()
            elapsed = time.perf_counter() - start
            tps = sum(o.stats["new_tokens"] for o in outs) / elapsed
            run_stats = (tps, sum(o.stats["decode_steps"] for o in outs), sum(o.stats["prefill_s"] for o in outs))
            best[name] = max(best.get(name, (0.0, 0.0, 0.0)), run_stats)
        responses[name] = [r for o in outs for r in o.responses]
    return best, sum(a == b for a, b in zip(responses["static"], responses["continuous"], strict=True))


def main_long_tail(make_model: Callable[[], Transformer], prompts: list[list[int]], args: argparse.Namespace) -> None:
    lengths = long_tail_lengths(len(prompts), args.new_tokens)
    print(f"response lengths: {sum(lengths)} tokens, median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}; "
          f"{args.long_tail} slots")
    print(f"{'precision':<30} {'static tok/s':>12} {'steps':>6} {'prefill s':>9} {'continuous tok/s':>16} "
          f"{'steps':>6} {'prefill s':>9} {'speedup':>8} {'same tokens':>11}")
    for name in args.precision or ["fp32"]:
        r, same = bench_long_tail(make_model, PRECISIONS[name], prompts, lengths, args.long_tail, args.repeats,
                                  args.backend)
        (s_tps, s_steps, s_pre), (c_tps, c_steps, c_pre) = r["static"], r["continuous"]
        print(f"{name:<30} {s_tps:>12.0f} {s_steps:>6.0f} {s_pre:>9.2f} {c_tps:>16.0f} {c_steps:>6.0f} {c_pre:>9.2f} "
              f"{c_tps / s_tps:>7.2f}x {same:>5}/{len(prompts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="prompts per call; 0: each engine's own largest batch "
                        "(Engine.max_batch in the free device memory less --reserve-gib)")
    parser.add_argument("--reserve-gib", type=float, default=2.0,
                        help="with --batch 0: memory left beyond the plan (its measured workspace included)")
    parser.add_argument("--record-layers", type=int, default=0, metavar="K",
                        help="the recording rows record the K deepest layers only (0: every layer); a 16K x 245 "
                             "rollout's parity records of all 48 layers would need ~570 GB of host memory")
    parser.add_argument("--records-to-host", action="store_true",
                        help="the recording rows stream their records to pinned host memory (long rollouts)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--long-tail", type=int, default=0, metavar="SLOTS",
                        help="static vs continuous batching in SLOTS slots on long-tailed response lengths")
    parser.add_argument("--precision", action="append", choices=list(PRECISIONS),
                        help="the precisions to run (repeatable; default: all on the CPU, the bf16 / FP4 rows on "
                             "CUDA, fp32 with --long-tail)")
    parser.add_argument("--preset", default="debug-moe", help="model preset (random weights)")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--backend", default="auto", help="auto (Triton on CUDA, sim on the CPU), triton or sim")
    parser.add_argument("--prefill-dense-from", type=int, default=None, metavar="TOKENS",
                        help="FP4 rows: forwards of at least TOKENS tokens (prefills) run dense GEMMs on dequantized "
                             "weights (Engine(prefill_dense_from=...)); compare prefill ms with and without")
    parser.add_argument("--peak-blocks", type=int, default=0, metavar="N",
                        help="CUDA: after the timed calls, one more under the allocator's recorder, and the N "
                             "allocation sites holding the most memory at its peak (what a plan leaves out)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="POSITIONS",
                        help="prefill POSITIONS prompt positions a forward (Engine(prefill_chunk=...)): compare peak "
                             "memory against the plan with and without")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"n_layers": args.layers} if args.layers else {}
    make_model = model_factory(args.preset, args.device, **overrides)
    config = MoEConfig.from_name(args.preset, **overrides)
    prompts = random_prompts(args.batch or 64, args.prompt_len, config.vocab_size)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"{args.preset} ({config.n_layers} layers), batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {where}, torch {torch.__version__}")
    if args.long_tail:
        main_long_tail(make_model, prompts, args)
        return
    names = args.precision or (list(ON_GPU) if args.device.startswith("cuda") else list(PRECISIONS))
    bandwidth = copy_bandwidth(torch.device(args.device))
    print(f"measured copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written); a decode step's floor is its bytes "
          "over it")
    print("| precision | batch | tok/s (whole call) | decode tok/s | prefill ms | ms/step | MB/step | GB/s "
          "| of copy bw | peak GiB | plan GiB | of it workspace |\n|---|" + "---:|" * 11)
    peak_lines: list[str] = []  # --peak-blocks: printed after the table
    for name in names:
        dense_from = args.prefill_dense_from if isinstance(PRECISIONS[name], FP4Precision) else None
        capture = CAPTURES.get(name)
        if capture is not None and args.records_to_host:
            capture = dataclasses.replace(capture, stream_to_host=True)
        if capture is not None and args.record_layers:
            n = config.n_layers
            capture = dataclasses.replace(capture, layers=set(range(max(0, n - args.record_layers), n)))
        r = bench(make_model, PRECISIONS[name], args.batch, args.prompt_len, params, args.repeats, capture,
                  args.backend, dense_from, args.reserve_gib, args.prefill_chunk, args.peak_blocks)
        gbps = r["MB/step"] / r["ms/step"]
        print(f"| {name} | {r['batch']:.0f} | {r['tok/s']:.0f} | {r['decode tok/s']:.0f} | {r['prefill ms']:.1f} | "
              f"{r['ms/step']:.2f} | {r['MB/step']:.1f} | {gbps:.1f} | {gbps * 1e9 / bandwidth:.0%} | "
              f"{r['peak GiB']:.2f} | {r['plan GiB']:.2f} | {r['workspace GiB']:.2f} |")
        peak_lines.extend(f"{name}: {line}" if i == 0 else line for i, line in enumerate(r.get("peak sites", [])))
    if peak_lines:
        print("\n".join(peak_lines))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
