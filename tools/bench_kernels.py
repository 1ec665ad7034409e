"""Kernel benchmarks on the GPU: quantizers vs the copy ceiling, FP4 GEMM / MoE / KV attention vs BF16 torch.

Run: python tools/bench_kernels.py  (CUDA only; prints JSON lines, then a markdown table)
Bytes are the fewest each op must move (inputs read once, outputs written once); % is of 4.25 TB/s.
Each op is timed as a CUDA graph replay (eager calls of small ops measure Python launch overhead instead).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from _bench import (
    Report,
    add_bw,
    add_kernel_option_args,
    bench_ms,
    empty_fp4_cache,
    graph_ms,
    kernel_options_from,
    nvfp4_bytes,
)
from torch import Tensor

from trace_lightning import kernels
from trace_lightning.quant import tensor_global_scale

BATCHES = (1, 16, 64, 256)


def copy_ceiling(rep: Report) -> None:
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    # eager: inside a CUDA graph this copy becomes a memcpy node, which ran at only ~2700 GB/s (v7's runs)
    ms = bench_ms(lambda: y.copy_(x))
    add_bw(rep, "copy", "1 GiB fp32", ms, 2 * x.nbytes)


QUANT_SHAPE = (16384, 8192)  # the quantizers' benchmark activation [R, K]


def quantizer_cases(x: Tensor) -> dict[str, tuple[Callable[[], Any], int]]:
    """The quantizers of x [R, K] as (call, the fewest bytes it must move: read + written)."""
    R, K = x.shape
    nv_out = nvfp4_bytes(R, K)
    g = torch.tensor(0.01, device=x.device)  # on the device: a Python float is copied from the host every call
    mx_bytes = x.nbytes + R * K // 2 + R * K // 32
    return {
        "quantize_nvfp4_rows": (lambda: kernels.quantize_nvfp4_rows(x), x.nbytes + nv_out),
        "quantize_nvfp4(scalar g)": (lambda: kernels.quantize_nvfp4(x, g), x.nbytes + nv_out - 4 * R),
        "fake_quantize_nvfp4_rows": (lambda: kernels.fake_quantize_nvfp4_rows(x), 2 * x.nbytes + nv_out),
        "quantize_mxfp4 floor": (lambda: kernels.quantize_mxfp4(x, "floor"), mx_bytes),
        "quantize_mxfp4 rceil": (lambda: kernels.quantize_mxfp4(x, "rceil"), mx_bytes),
    }


def quantizers(rep: Report) -> None:
    R, K = QUANT_SHAPE
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16) * 3
    cases = quantizer_cases(x)
    packed = kernels.quantize_nvfp4_rows(x).packed
    cases["pack_parity"] = (lambda: kernels.pack_parity(packed), packed.nbytes * 5 // 4)
    for name, (fn, nbytes) in cases.items():
        ms = graph_ms(fn)
        add_bw(rep, name, f"{R}x{K} bf16", ms, nbytes)


def linears(rep: Report) -> None:
    for N, K, name in ((5120, 2048, "wqkv"), (2048, 4096, "wo")):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = kernels.prepare_weight(kernels.quantize_nvfp4(w, tensor_global_scale(w, 2)), w.dtype)
        for M in BATCHES:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ms16 = graph_ms(partial(torch.matmul, x, w.T))
            ms4 = graph_ms(partial(kernels.fp4_linear, x, wq))
            io = x.nbytes + M * N * 2
            add_bw(rep, f"linear {name} bf16", f"M={M} {N}x{K}", ms16, w.nbytes + io)
            add_bw(rep, f"linear {name} fp4", f"M={M} {N}x{K}", ms4, nvfp4_bytes(N, K) + io, speedup=ms16 / ms4)


def bf16_moe(x: Tensor, w13: Tensor, w2: Tensor, ids: Tensor, gates: Tensor) -> Tensor:
    """The BF16 baseline: pairs sorted by expert, torch._grouped_mm for both GEMMs (no host sync)."""
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x[order // k]
    gate, up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(N, k, -1) * gates.unsqueeze(-1)).sum(1)


def moe(rep: Report) -> None:
    E, D, I, k = 128, 2048, 768, 8
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02
    g13, g2 = tensor_global_scale(w13, 2).unsqueeze(-1), tensor_global_scale(w2, 2).unsqueeze(-1)
    q13 = kernels.prepare_weight(kernels.quantize_nvfp4(w13, g13), w13.dtype)
    q2 = kernels.prepare_weight(kernels.quantize_nvfp4(w2, g2), w2.dtype)
    per_expert4 = nvfp4_bytes(2 * I, D) + nvfp4_bytes(D, I)
    per_expert16 = (2 * I * D + D * I) * 2
    for N in BATCHES:
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        gates, ids = torch.rand(N, E, device="cuda").softmax(-1).topk(k, dim=-1)
        gates = (gates / gates.sum(-1, keepdim=True)).bfloat16()
        touched = int(ids.unique().numel())
        ms16 = graph_ms(partial(bf16_moe, x, w13, w2, ids, gates))
        ms4 = graph_ms(partial(kernels.fp4_moe, x, q13, q2, ids, gates))
        shape = f"N={N} E={E} touched={touched}"
        add_bw(rep, "moe bf16 grouped_mm", shape, ms16, touched * per_expert16)
        add_bw(rep, "moe fp4 fused", shape, ms4, touched * per_expert4, speedup=ms16 / ms4)


def attention(rep: Report, ctx: int = 2048) -> None:
    Hq, Hkv, Dh = 32, 4, 128
    for B in BATCHES:
        S = ctx + 1
        k16 = torch.randn(B, Hkv, S, Dh, device="cuda", dtype=torch.bfloat16)
        v16 = torch.randn_like(k16)
        q = torch.randn(B, Hq, 1, Dh, device="cuda", dtype=torch.bfloat16)
        layer = empty_fp4_cache(B, Hkv, S, Dh)
        kernels.kv_append(layer, k16.transpose(1, 2), v16.transpose(1, 2),
                          torch.arange(S, device="cuda").expand(B, S))
        pos = torch.full((B, 1), ctx, device="cuda", dtype=torch.int64)
        ms16 = graph_ms(partial(F.scaled_dot_product_attention, q, k16, v16, enable_gqa=True))
        ms4 = graph_ms(partial(kernels.fp4_kv_attention, q, layer, pos, Dh**-0.5))
        add_bw(rep, "attn bf16 sdpa", f"B={B} ctx={ctx}", ms16, 2 * k16.nbytes)
        add_bw(rep, "attn fp4 kv", f"B={B} ctx={ctx}", ms4, layer.nbytes(), speedup=ms16 / ms4)
        kn, vn = torch.randn(2, B, 1, Hkv, Dh, device="cuda", dtype=torch.bfloat16)
        ms_app = graph_ms(partial(kernels.kv_append, layer, kn, vn, pos))
        rep.add(op="kv_append fp4", shape=f"B={B}", ms=ms_app)
        del k16, v16, layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=["copy", "quant", "linear", "moe", "attn"])
    add_kernel_option_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device")
    with kernels.kernel_options(kernel_options_from(args)):
        run(args.only)


def run(only: list[str]) -> None:
    """The sections named in `only`, then their table."""
    torch.manual_seed(0)
    rep = Report(["op", "shape", "ms", "MB", "GBps", "pct", "speedup"])
    sections = {"copy": copy_ceiling, "quant": quantizers, "linear": linears, "moe": moe, "attn": attention}
    for name in only:
        try:
            sections[name](rep)
        except Exception as err:  # noqa: BLE001  (one failing section must not hide the others' numbers)
            print(f"# section {name} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            import traceback

            traceback.print_exc()
    print(f"\n## kernels on {torch.cuda.get_device_name()} (pct = GB/s over 4.25 TB/s; speedup = bf16 ms / fp4 ms)\n")
    print(rep.table())


if __name__ == "__main__":
    main()
