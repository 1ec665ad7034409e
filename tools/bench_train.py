"""Where the training step's time goes: one RL micro-step (forward, token logprobs, backward) of a preset, per variant.

Run: python tools/bench_train.py --preset medium-moe --micro-batch 4 --seq 1050   (CUDA; the CPU works, slowly)
The forward is the policy's own (`Transformer`), with the hook the method trains with: none (bf16: the finite check
only), FP4 fake quantization of weights and activations (fp4_qat) by the fused kernels (on CUDA) or by the
reference's torch ops, its weights quantized each micro-step or once a step (`step cache`, as the fit runs it: the
timed micro-steps reuse the warm-up's), or trace_compact's guided forward (`guided parity`: parity records of every
layer that the FP4 engine captured for these tokens, in pinned host memory, with pad positions; each site read in
place by one kernel, or, `ref copies`, copied out of the record and unpacked first, as before that kernel).
Variants: the MoE's expert GEMMs as a loop over experts or as one grouped GEMM, and fp32 matmuls in full fp32 or
TF32, or the forward under bf16 autocast (the fit's `--model.train_compute bf16`). Prints ms a micro-step,
tokens/s, peak GiB, and each variant's largest logprob difference from the first; `--profile` adds the first
variant's largest kernels and host ops, `--host-profile` its largest Python functions.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import gc
import io
import pstats
import time
from collections.abc import Callable
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from trace_lightning.guidance import BatchRecord
from trace_lightning.guidance.hook import FakeQuantHook, FiniteCheckHook, GuidedHook
from trace_lightning.lit.collector import CollectorTime
from trace_lightning.lit.profiling import host_and_device
from trace_lightning.model import model as model_module
from trace_lightning.model.hooks import QuantHook
from trace_lightning.model.model import Transformer
from trace_lightning.quant import FakeQuantCache
from trace_lightning.quant import fake as fake_module
from trace_lightning.rl.logprobs import token_logprobs
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams

VARIANTS = {  # name: (expert GEMMs grouped, fp32 matmul precision, autocast dtype: the fit's train_compute)
    "loop, fp32": (False, "highest", None),
    "grouped, fp32": (True, "highest", None),
    "grouped, tf32": (True, "high", None),
    "grouped, bf16 autocast": (True, "highest", torch.bfloat16),
}


class _RefCopiesHook(GuidedHook):
    """GuidedHook as it ran before the in-place record kernel: each site's ref copied out and unpacked, then the
    guided kernel (the before of a before / after)."""

    def _guided_in_place(self, x: torch.Tensor, valid: torch.Tensor, layer: int, site: str) -> None:  # noqa: ARG002
        return None


def micro_step(policy: Transformer, tokens: torch.Tensor, hook_factory: Callable[[], QuantHook],
               autocast: torch.dtype | None = None) -> torch.Tensor:
    hook = hook_factory()
    hook.deferred = True  # as the training forward runs it: one host sync after the forward, not one a site
    with torch.autocast(tokens.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = policy(tokens[:, :-1], hook=hook)
    logprobs = token_logprobs(logits.float(), tokens[:, 1:])
    (-logprobs.mean()).backward()
    return logprobs.detach()


def rollout_record(policy: Transformer, tokens: torch.Tensor) -> BatchRecord:
    """Parity records of every layer for tokens[:, :-1], as the FP4 engine captures them (a prefill of the tokens,
    bf16 compute), in host memory (pinned on a GPU), where the long fit holds them (records_on_host)."""
    engine = Engine(copy.deepcopy(policy), FP4Precision(compute_dtype="bf16"))
    out = engine.generate(tokens.tolist(), SamplingParams(max_new_tokens=1, stop_token_ids=[]),
                          capture=CaptureSpec(mode="parity"))
    assert out.record is not None
    record = out.record.window(tokens.shape[1] - 1)
    del engine, out
    host = record.to("cpu")
    data = host.data.contiguous()
    return dataclasses.replace(host, data=data.pin_memory() if tokens.is_cuda else data)


def timed(fn: Callable[[], torch.Tensor], reps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps, out


def allocator_counts(device: torch.device) -> tuple[int, int, int]:
    """The CUDA caching allocator's device allocations, frees and retries so far (a cudaFree synchronizes the device:
    a step that frees or retries idles the GPU where no profiler table shows it); zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0, 0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0), stats.get("num_alloc_retries", 0)


def top_ops(fn: Callable[[], torch.Tensor], device: torch.device, rows: int, trace: str | None = None) -> None:
    """The largest ops of one call, and whether it is launch-bound: wall time against the device's busy time (the
    sum of its kernels' times) and the number of kernel launches; with `trace`, its Chrome trace written there (the
    gaps where the device waits, which neither table shows)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    if device.type == "cuda":  # the host's side: what a micro-step the device waits on spends its time on
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(f"profiled call: {host_and_device(averages, wall)}")
    if trace:
        prof.export_chrome_trace(trace)
        print(f"Chrome trace: {trace}")


def host_profile(fn: Callable[[], torch.Tensor], device: torch.device, rows: int) -> None:
    """The Python functions that take the host's time in one call (cProfile, by own time): where a micro-step whose
    device is idle part of the time spends it enqueueing work."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    head, table = out.getvalue().split("   ncalls", 1)
    print(next(line.strip() for line in head.splitlines() if "function calls" in line))  # calls and host seconds
    print("   ncalls" + table.rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="medium-moe")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1050, help="tokens a sequence (prompt + response)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-gc", action="store_true",
                        help="Python's cyclic garbage collector off while the micro-steps run (collected between "
                             "hooks): whether its pauses, which no profiler table shows, idle the device")
    parser.add_argument("--hooks", nargs="*", default=["none", "fake_quant", "fake_quant, step cache"],
                        choices=["none", "fake_quant", "fake_quant, step cache", "fake_quant, step cache, torch ops",
                                 "guided parity, step cache", "guided parity, step cache, ref copies"],
                        help="guided parity: trace_compact's forward, rounded to parity records of every layer that "
                             "the FP4 engine captured for these tokens (held in host memory, as the long fit holds "
                             "them; --pad positions of the first row count as padding); ref copies: each site's "
                             "ref copied out of the record and unpacked first, as before the in-place kernel")
    parser.add_argument("--pad", type=int, default=24,
                        help="guided: the first row's last PAD positions are padding (plain rounding there, as in a "
                             "fit's right-padded batch); 0: none")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trace", metavar="PREFIX",
                        help="with --profile: each hook's profiled micro-step as a Chrome trace, PREFIX<hook>.json")
    parser.add_argument("--host-profile", action="store_true",
                        help="the first variant's largest Python functions by own time (cProfile, one micro-step)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    overrides = {"n_layers": args.layers} if args.layers else {}
    policy = Transformer.from_name(args.preset, **overrides).to(device)
    tokens = torch.randint(0, policy.config.vocab_size, (args.micro_batch, args.seq), device=device)
    step_weights = FakeQuantCache()  # as the fit shares it over a step's micro-batches (the timed ones reuse it)
    hooks: dict[str, Callable[[], QuantHook]] = {
        "none": FiniteCheckHook,
        "fake_quant": lambda: FakeQuantHook("nvfp4"),
        "fake_quant, step cache": lambda: FakeQuantHook("nvfp4", weights=step_weights),
    }
    hooks["fake_quant, step cache, torch ops"] = hooks["fake_quant, step cache"]  # the same hook, unfused
    if "guided parity, step cache" in args.hooks:
        record = rollout_record(policy, tokens)
        valid = torch.ones(args.micro_batch, args.seq - 1, dtype=torch.bool, device=device)
        if args.pad:
            valid[0, -args.pad:] = False
        full = None if args.pad else True  # as the fit's trainer tells its hooks (PolicyModule.recorded_rows)
        hooks["guided parity, step cache"] = lambda: GuidedHook("nvfp4", record, "parity", valid, weights=step_weights,
                                                                all_recorded=full)
        hooks["guided parity, step cache, ref copies"] = lambda: _RefCopiesHook("nvfp4", record, "parity", valid,
                                                                                weights=step_weights)
    fused_default = fake_module._fused_wanted
    same_dtype = lambda x, w: x.dtype == w.dtype  # noqa: E731  (the grouped GEMM for fp32 on CUDA too)
    n_tokens = args.micro_batch * (args.seq - 1)
    print(f"{args.preset}, {policy.config.n_layers} layers, micro-batch {args.micro_batch} x {args.seq} tokens, "
          f"{device}: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
          + (", Python's cyclic GC off" if args.no_gc else ""))
    print("| hook | variant | ms a micro-step | tokens/s | peak GiB | cudaMalloc / cudaFree / retries a micro-step | "
          "Python GC ms a micro-step | max abs logprob diff from the first |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    grouped_default = model_module._use_grouped_mm
    if args.no_gc:
        gc.collect()
        gc.disable()
    for hook_name in args.hooks:
        first: torch.Tensor | None = None
        # "torch ops": the reference quantizer's ops instead of the fused fake-quant kernels (the path before them)
        fake_module._fused_wanted = (lambda x: False) if hook_name.endswith("torch ops") else fused_default  # noqa: ARG005
        for variant in args.variants:
            grouped, precision, autocast = VARIANTS[variant]
            model_module._use_grouped_mm = same_dtype if grouped else (lambda x, w: False)  # noqa: ARG005
            for experts in (layer.moe.experts for layer in policy.layers):
                experts.use_grouped_mm = grouped
            torch.set_float32_matmul_precision(precision)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            policy.zero_grad(set_to_none=True)
            step_weights.clear()
            if args.no_gc:
                gc.collect()
            step = partial(micro_step, policy, tokens, hooks[hook_name], autocast)
            try:
                before = allocator_counts(device)
                with CollectorTime() as collector:
                    seconds, logprobs = timed(step, args.reps, device)
                allocations = "/".join(f"{(b - a) / (args.reps + 1):.1f}"
                                       for a, b in zip(before, allocator_counts(device), strict=True))
            except torch.OutOfMemoryError:
                print(f"| {hook_name} | {variant} | out of memory | | | | | |")
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            diff = 0.0 if first is None else float((logprobs - first).abs().max())
            first = logprobs if first is None else first
            print(f"| {hook_name} | {variant} | {seconds * 1e3:.1f} | {n_tokens / seconds:,.0f} | {peak:.1f} | "
                  f"{allocations} | {collector.seconds * 1e3 / (args.reps + 1):.1f} | {diff:.2e} |", flush=True)
            if args.profile and variant == args.variants[0]:
                name = "".join(c if c.isalnum() else "_" for c in hook_name)
                top_ops(step, device, 25, f"{args.trace}{name}.json" if args.trace else None)
            if args.host_profile and variant == args.variants[0]:
                host_profile(step, device, 25)
    model_module._use_grouped_mm = grouped_default
    torch.set_float32_matmul_precision("highest")
    gc.enable()


if __name__ == "__main__":
    main()
