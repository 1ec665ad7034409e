"""Shared benchmark plumbing (GPU.md protocol): median of CUDA-event timings, JSON lines, a markdown table."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

from trace_lightning import kernels
from trace_lightning.ops import FP4KVLayer

COPY_CEILING = 4.25e12  # bytes/s read + written, device-to-device copy measured on the H200 (GPU.md)


def add_kernel_option_args(parser: argparse.ArgumentParser) -> None:
    """The KernelOptions a benchmark may set (kernels/_common.py); every default is the kernels' own."""
    parser.add_argument("--autotune", action="store_true", help="autotune GEMM and attention block shapes")
    parser.add_argument("--no-pdl", action="store_true", help="plain launches, no programmatic dependent launch")
    parser.add_argument("--attention-shape", default=None, metavar="KEYS,WARPS,STAGES,PER_SM",
                        help="one decode attention launch shape at every length (tools/sweep_attention.py's BEST)")


def kernel_options_from(args: argparse.Namespace) -> kernels.KernelOptions:
    """KernelOptions from add_kernel_option_args' flags."""
    shape: dict[str, Any] = {}
    if args.attention_shape:
        values = [int(v) for v in args.attention_shape.split(",")]
        if len(values) != 4:
            raise SystemExit(f"--attention-shape needs keys,warps,stages,per_sm, got {args.attention_shape!r}")
        shape = {"attention": kernels.AttentionLaunch(*values[:3]), "attention_long": None,
                 "attention_programs_per_sm": values[3]}
    return kernels.KernelOptions(autotune=args.autotune, pdl=not args.no_pdl, **shape)


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds (triton.testing.do_bench: warm-up, L2 flushed before each run, CUDA events)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_of(fn: Callable[[], Any]) -> Callable[[], Any] | None:
    """A CUDA graph replay of fn (warmed up on a side stream), or None when capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay
    except Exception as err:  # noqa: BLE001  (report and fall back to eager)
        print(f"# graph capture failed: {type(err).__name__}: {err}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def graph_ms(fn: Callable[[], Any]) -> float:
    """bench_ms of fn's CUDA graph replay (eager when capture fails)."""
    replay = graph_of(fn)
    return bench_ms(replay if replay is not None else fn)


class Report:
    """Collects rows; prints each as a JSON line at once and all as a markdown table at the end."""

    def __init__(self, columns: list[str]) -> None:
        self.columns, self.rows = columns, []

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def table(self) -> str:
        def fmt(v: Any) -> str:
            return f"{v:.4g}" if isinstance(v, float) else str(v)

        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in self.columns) + " |" for r in self.rows]
        return "\n".join(lines)


def add_bw(rep: Report, op: str, shape: str, ms: float, nbytes: int, **extra: Any) -> None:
    """A row with achieved bandwidth and its share of the 4.25 TB/s copy ceiling."""
    gbps = nbytes / ms / 1e6
    rep.add(op=op, shape=shape, ms=ms, MB=nbytes / 1e6, GBps=gbps, pct=gbps * 1e9 / COPY_CEILING * 100, **extra)


def nvfp4_bytes(rows: int, cols: int) -> int:
    """Bytes of an NVFP4 matrix: packed codes, E4M3 scales, one float32 global per row."""
    return rows * cols // 2 + rows * cols // 16 + rows * 4


def empty_fp4_cache(B: int, kv_heads: int, S: int, head_dim: int) -> FP4KVLayer:
    """One layer's FP4 KV cache in the layouts the engine gives it on this device (word layout, value tiles)."""
    return FP4KVLayer.allocate(B, kv_heads, S, head_dim, "cuda",
                               words=kernels.prefers_word_layout(torch.bfloat16, "cuda", cache=True),
                               value_tiles=kernels.prefers_value_tiles(torch.bfloat16, "cuda"))


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int | None = None, runs: int = 5) -> float:
    """This device's measured copy bandwidth, bytes/s read + written (best of `runs` copies of `nbytes`: 2 GiB on a
    GPU, 256 MiB on the CPU): the roofline an engine's decode step is held to, measured here, not quoted."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = timed_s(functools.partial(dst.copy_, src), device, runs=1)
    for _ in range(runs - 1):
        best = min(best, timed_s(functools.partial(dst.copy_, src), device, runs=1))
    return 2 * nbytes / best


def timed_s(fn: Callable[[], object], device: torch.device, runs: int = 3) -> float:
    """Median wall seconds of fn (after one warm-up call), synchronizing the device around each call: for work
    that is not one kernel (a whole generate call, a weight sync), where do_bench's L2 flush is beside the point."""
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
