"""One decode step of a qwen3-30b-a3b-shaped MoE, BF16 torch ops vs our FP4 ops, next to its roofline.

Run: python tools/bench_rollout.py --layers 8 --batches 1 16 64 256 --ctx 2048
     python tools/bench_rollout.py --layers 8 --long 16384   (long rollouts, see long_rollout)
Random weights (never zeros). BF16 path: torch bf16 matmuls, SDPA over a bf16 cache, torch._grouped_mm
experts. FP4 path: W4 weights + A4 activations (fake_quantize_nvfp4_rows at attn_in/attn_out/moe_in, the
fused moe_down) + FP4 KV cache, all through trace_lightning.kernels. Norms, RoPE, router, lm_head stay bf16
in both; the norms, the q / k norm + RoPE and the router's softmax + top-k (after its F.linear) run through the
engine's one-launch kernels in both (--unfused-rope / --torch-router: the torch ops they replace). `--layers`
are measured (captured as one CUDA graph per path) and scaled to the model's 48; the lm_head is measured on
its own and added once. Roofline = (weight bytes touched + KV bytes) / 4.25 TB/s.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from _bench import (
    COPY_CEILING,
    Report,
    add_kernel_option_args,
    bench_ms,
    empty_fp4_cache,
    graph_ms,
    graph_of,
    kernel_options_from,
    nvfp4_bytes,
)
from bench_kernels import bf16_moe
from torch import Tensor

from trace_lightning import kernels
from trace_lightning.model.model import apply_rope
from trace_lightning.ops import FP4KVLayer
from trace_lightning.quant import NVFP4, tensor_global_scale


@dataclass(frozen=True)
class Shape:
    layers: int = 48
    dim: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    inter: int = 768
    vocab: int = 151936


def rms(x: Tensor, w: Tensor) -> Tensor:
    """The engine's norm on GPU in both paths: one kernel (kernels.rms_norm), the model's arithmetic."""
    return kernels.rms_norm(x, w, 1e-6)


def quantize_weight(w: Tensor) -> NVFP4:
    """NVFP4 of w with per-matrix globals, in the layout the engine holds it in (kernels.prepare_weight)."""
    g = tensor_global_scale(w, 2)
    return kernels.prepare_weight(kernels.quantize_nvfp4(w, g.unsqueeze(-1) if w.dim() == 3 else g), w.dtype)


class Layer:
    """One transformer block's random weights, in bf16 and in NVFP4 (quantized from the same tensors)."""

    def __init__(self, s: Shape) -> None:
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def rnd(*shape: int, std: float = 0.02) -> Tensor:
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * std

        self.wqkv, self.wo = rnd(q_dim + 2 * kv_dim, s.dim), rnd(s.dim, q_dim)
        self.router = rnd(s.experts, s.dim)
        self.w13, self.w2 = rnd(s.experts, 2 * s.inter, s.dim), rnd(s.experts, s.dim, s.inter)
        self.n1, self.n2, self.qn, self.kn = (1 + rnd(d, std=0.1) for d in (s.dim, s.dim, s.head_dim, s.head_dim))
        self.wqkv4, self.wo4 = quantize_weight(self.wqkv), quantize_weight(self.wo)
        self.w13_4, self.w2_4 = quantize_weight(self.w13), quantize_weight(self.w2)


def attn_proj(s: Shape, layer: Layer, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B = qkv.shape[0]
    q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    q, k = q.view(B, 1, s.heads, s.head_dim), k.view(B, 1, s.kv_heads, s.head_dim)
    if UNFUSED_ROPE:  # the model's torch ops (the before of kernels.rope)
        q, k = apply_rope(rms(q, layer.qn), cos, sin), apply_rope(rms(k, layer.kn), cos, sin)
    else:  # the engine's head norm + RoPE in both paths: one kernel each for q and k
        q, k = kernels.rope(q, cos, sin, layer.qn, 1e-6), kernels.rope(k, cos, sin, layer.kn, 1e-6)
    return q.view(B, s.heads, s.head_dim), k.view(B, s.kv_heads, s.head_dim), v.view(B, s.kv_heads, s.head_dim)


UNFUSED_ROPE = False  # --unfused-rope
TORCH_ROUTER = False  # --torch-router


FIXED_ROUTING = False  # --fixed-routing: every layer routes batch row b to the same random experts, whatever h is
_FIXED: dict[int, tuple[Tensor, Tensor]] = {}  # batch -> (gates, ids), made on the warm-up call (outside capture)


def route(s: Shape, layer: Layer, h: Tensor) -> tuple[Tensor, Tensor]:
    if FIXED_ROUTING:
        B = h.shape[0]
        if B not in _FIXED:
            gen = torch.Generator(device="cuda").manual_seed(B)
            ids = torch.rand(B, s.experts, device="cuda", generator=gen).topk(s.top_k, dim=-1).indices
            _FIXED[B] = (torch.full(ids.shape, 1.0 / s.top_k, device="cuda", dtype=h.dtype), ids)
        return _FIXED[B]
    logits = F.linear(h, layer.router)  # (B, E)
    if not TORCH_ROUTER:  # the engine's router in both paths: one kernel after the GEMV
        return kernels.route_topk(logits, s.top_k, "softmax", True, h.dtype)
    gates, ids = logits.float().softmax(-1).topk(s.top_k, dim=-1)  # the model's torch ops (the before)
    return (gates / gates.sum(-1, keepdim=True)).to(h.dtype), ids


def bf16_layer(s: Shape, layer: Layer, cache: tuple[Tensor, Tensor], x: Tensor, pos: Tensor, cos: Tensor,
               sin: Tensor) -> Tensor:
    B = x.shape[0]
    q, k, v = attn_proj(s, layer, rms(x, layer.n1) @ layer.wqkv.T, cos, sin)
    cache[0].index_copy_(2, pos[:1], k[:, :, None])  # every row decodes at the same position here
    cache[1].index_copy_(2, pos[:1], v[:, :, None])
    o = F.scaled_dot_product_attention(q[:, :, None], cache[0], cache[1], enable_gqa=True)  # (B, Hq, 1, Dh)
    x = x + o.reshape(B, -1) @ layer.wo.T
    h = rms(x, layer.n2)
    gates, ids = route(s, layer, h)
    return x + bf16_moe(h, layer.w13, layer.w2, ids, gates)


def fp4_layer(s: Shape, layer: Layer, cache: FP4KVLayer, x: Tensor, pos: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    B = x.shape[0]
    hq, _ = kernels.fake_quantize_nvfp4_rows(rms(x, layer.n1))  # attn_in
    q, k, v = attn_proj(s, layer, kernels.fp4_linear(hq, layer.wqkv4), cos, sin)
    kernels.kv_append(cache, k[:, None], v[:, None], pos[:, None])  # k, v sites
    o = kernels.fp4_kv_attention(q[:, :, None], cache, pos[:, None], s.head_dim**-0.5)  # (B, Hq, 1, Dh)
    oq, _ = kernels.fake_quantize_nvfp4_rows(o.reshape(B, -1))  # attn_out
    x = x + kernels.fp4_linear(oq, layer.wo4)
    h = rms(x, layer.n2)
    gates, ids = route(s, layer, h)
    hq, _ = kernels.fake_quantize_nvfp4_rows(h)  # moe_in
    return x + kernels.fp4_moe(hq, layer.w13_4, layer.w2_4, ids, gates)[0]  # moe_down inside


def step(layer_fn, layers: list[Layer], caches: list, x: Tensor, out: Tensor, *args: Tensor) -> None:  # noqa: ANN001
    for layer, cache in zip(layers, caches, strict=True):
        x = layer_fn(layer, cache, x, *args)
    out.copy_(x)


def touched_experts(s: Shape, layers: list[Layer], x: Tensor) -> float:
    """Mean distinct experts per layer that this batch routes to (router on the step's input)."""
    counts = [route(s, layer, rms(x, layer.n2))[1].unique().numel() for layer in layers]
    return sum(counts) / len(counts)


def roofline_bytes(s: Shape, B: int, ctx: int, touched: float, fp4: bool) -> tuple[float, float]:
    """(weight bytes touched, KV bytes read) of a full-depth decode step."""
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    mats = [(q_dim + 2 * kv_dim, s.dim), (s.dim, q_dim)]
    expert = [(2 * s.inter, s.dim), (s.dim, s.inter)]
    size = (lambda r, c: nvfp4_bytes(r, c)) if fp4 else (lambda r, c: 2 * r * c)
    per_layer = sum(size(r, c) for r, c in mats) + touched * sum(size(r, c) for r, c in expert)
    per_layer += 2 * s.experts * s.dim + 4 * 2 * s.dim  # router and norms stay bf16
    head = 2 * s.vocab * s.dim + 2 * s.dim
    kv_row = (s.head_dim // 2 + s.head_dim // 16 + 4) if fp4 else 2 * s.head_dim
    kv = s.layers * B * (ctx + 1) * s.kv_heads * 2 * kv_row
    return s.layers * per_layer + head, kv


def fill_caches(s: Shape, L: int, B: int, ctx: int) -> tuple[list[tuple[Tensor, Tensor]], list[FP4KVLayer]]:
    bf16, fp4 = [], []
    for _ in range(L):
        k = torch.randn(B, s.kv_heads, ctx + 1, s.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        layer = empty_fp4_cache(B, s.kv_heads, ctx + 1, s.head_dim)
        kernels.kv_append(layer, k.transpose(1, 2), v.transpose(1, 2),
                          torch.arange(ctx + 1, device="cuda").expand(B, ctx + 1))
        bf16.append((k, v))
        fp4.append(layer)
    return bf16, fp4


def step_inputs(s: Shape, B: int, ctx: int, device: str = "cuda") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x [B, D] bf16, positions [B], cos, sin [B, 1, Dh]) of a decode step at position ctx (RoPE theta 1e6)."""
    x = torch.randn(B, s.dim, device=device, dtype=torch.bfloat16)
    pos = torch.full((B,), ctx, device=device, dtype=torch.int64)
    inv = 1.0 / (1e6 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
    ang = torch.cat([ctx * inv, ctx * inv]).to(torch.bfloat16)
    return x, pos, ang.cos().expand(B, 1, -1).contiguous(), ang.sin().expand(B, 1, -1).contiguous()


def timed(fn) -> tuple[float, str]:  # noqa: ANN001
    replay = graph_of(fn)
    return (bench_ms(replay), "graph") if replay is not None else (bench_ms(fn), "eager")


def run_batch(rep: Report, s: Shape, layers: list[Layer], B: int, ctx: int, head: Tensor) -> None:
    L = len(layers)
    caches16, caches4 = fill_caches(s, L, B, ctx)
    x, pos, cos, sin = step_inputs(s, B, ctx)
    out16, out4 = torch.empty_like(x), torch.empty_like(x)
    ms16, mode16 = timed(partial(step, partial(bf16_layer, s), layers, caches16, x, out16, pos, cos, sin))
    ms4, mode4 = timed(partial(step, partial(fp4_layer, s), layers, caches4, x, out4, pos, cos, sin))
    head_ms = graph_ms(partial(torch.matmul, rms(x, layers[0].n1), head.T))
    diff = float((out4.float() - out16.float()).norm() / out16.float().norm())
    if not (torch.isfinite(out4).all() and torch.isfinite(out16).all()):  # NaN logits route every token alike
        print(f"# WARNING batch {B}: non-finite step output, so top-k routing collapsed onto the same experts "
              "and these times are not valid", file=sys.stderr)
    touched = touched_experts(s, layers, x)
    for name, ms, mode, fp4 in (("bf16", ms16, mode16, False), ("fp4", ms4, mode4, True)):
        full = ms / L * s.layers + head_ms
        w, kv = roofline_bytes(s, B, ctx, touched, fp4)
        floor_ms = (w + kv) / COPY_CEILING * 1e3
        rep.add(path=name, batch=B, ctx=ctx, measured_layers=L, mode=mode, layers_ms=ms, step_ms_48=full,
                roofline_ms=floor_ms, pct_roofline=floor_ms / full * 100, weights_GB=w / 1e9, kv_GB=kv / 1e9,
                touched=touched, tok_per_s=B / full * 1e3,
                speedup=(ms16 / L * s.layers + head_ms) / full if fp4 else 1.0, rel_diff_vs_bf16=diff if fp4 else 0.0)
    del caches16, caches4
    torch.cuda.empty_cache()


def weight_bytes_resident(s: Shape, fp4: bool) -> float:
    """Bytes of the whole 48-layer model in memory (every expert, embedding and lm_head bf16 in both)."""
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    size = (lambda r, c: nvfp4_bytes(r, c)) if fp4 else (lambda r, c: 2 * r * c)
    per_layer = size(q_dim + 2 * kv_dim, s.dim) + size(s.dim, q_dim)
    per_layer += s.experts * (size(2 * s.inter, s.dim) + size(s.dim, s.inter)) + 2 * s.experts * s.dim + 8 * s.dim
    return s.layers * per_layer + 2 * 2 * s.vocab * s.dim


def kv_bytes_per_token(s: Shape, fp4: bool) -> float:
    row = (s.head_dim // 2 + s.head_dim // 16 + 4) if fp4 else 2 * s.head_dim
    return s.layers * s.kv_heads * 2 * row


def max_batch(s: Shape, fp4: bool, seq_len: int, reserve_gb: float) -> int:
    """Largest batch whose weights + full-length KV cache fit the device, leaving reserve_gb for workspace."""
    free = torch.cuda.get_device_properties(0).total_memory - reserve_gb * 2**30 - weight_bytes_resident(s, fp4)
    return max(1, int(free // (kv_bytes_per_token(s, fp4) * seq_len)))


def step_at(s: Shape, layers: list[Layer], fp4: bool, caches: list, B: int, ctx: int, head: Tensor) -> float:
    """Graph-replayed ms of one 48-layer decode step (measured layers scaled, lm_head added) at position ctx."""
    x, pos, cos, sin = step_inputs(s, B, ctx)
    out = torch.empty_like(x)
    if fp4:
        fn = partial(step, partial(fp4_layer, s), layers, caches, x, out, pos, cos, sin)
    else:  # SDPA attends to the whole tensor it gets: hand it the first ctx + 1 positions
        views = [(k[:, :, : ctx + 1], v[:, :, : ctx + 1]) for k, v in caches]
        fn = partial(step, partial(bf16_layer, s), layers, views, x, out, pos, cos, sin)
    ms, _ = timed(fn)
    head_ms = graph_ms(partial(torch.matmul, rms(x, layers[0].n1), head.T))
    return ms / len(layers) * s.layers + head_ms


def random_fp4_cache(B: int, kv_heads: int, S: int, head_dim: int, chunk: int = 16) -> FP4KVLayer:
    """A full FP4 cache of random K/V, quantized `chunk` sequences at a time (bounds the bf16 staging memory)."""
    layer = empty_fp4_cache(B, kv_heads, S, head_dim)
    for b0 in range(0, B, chunk):
        sub = layer.batch_rows(b0, b0 + chunk)
        n = sub.shape[0]
        kv = torch.randn(2, n, S, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kernels.kv_append(sub, kv[0], kv[1], torch.arange(S, device="cuda").expand(n, S))
    return layer


def long_rollout(rep: Report, s: Shape, layers: list[Layer], head: Tensor, gen: int, prompt: int,
                 reserve_gb: float, points: int = 5) -> None:
    """Generated tokens/s of gen-token rollouts at each engine's largest batch that fits (full 48-layer
    weights + KV for prompt + gen tokens, computed from byte counts): step times measured at `points`
    positions across the generation and integrated (trapezoid), prefill excluded."""
    L = len(layers)
    S = prompt + gen + 1
    for fp4 in (False, True):
        name = "fp4" if fp4 else "bf16"
        B = max_batch(s, fp4, S, reserve_gb)
        if fp4:
            caches = [random_fp4_cache(B, s.kv_heads, S, s.head_dim) for _ in range(L)]
        else:
            caches = [(torch.randn(B, s.kv_heads, S, s.head_dim, device="cuda", dtype=torch.bfloat16),
                       torch.randn(B, s.kv_heads, S, s.head_dim, device="cuda", dtype=torch.bfloat16))
                      for _ in range(L)]
        ctxs = [prompt + round(j * (gen - 1) / (points - 1)) for j in range(points)]
        times = [step_at(s, layers, fp4, caches, B, c, head) for c in ctxs]
        total_ms = sum((ctxs[j + 1] - ctxs[j]) * (times[j] + times[j + 1]) / 2 for j in range(points - 1))
        rep.add(path=name, batch=B, gen=gen, prompt=prompt, step_ms_first=times[0], step_ms_last=times[-1],
                steps_ms=[round(t, 3) for t in times], rollout_s=total_ms / 1e3, tok_per_s=B * gen / total_ms * 1e3,
                kv_GB=kv_bytes_per_token(s, fp4) * S * B / 1e9, weights_GB=weight_bytes_resident(s, fp4) / 1e9)
        del caches
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8, help="layers measured (scaled to 48)")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--long", type=int, default=0, help="generated tokens of the long-rollout benchmark (0: off)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of the long-rollout benchmark")
    parser.add_argument("--fixed-routing", action="store_true",
                        help="route from a fixed random table, not the router: times that do not depend on values "
                             "(for experiments that break the numerics)")
    parser.add_argument("--unfused-rope", action="store_true",
                        help="q / k norm + RoPE with the model's torch ops instead of kernels.rope (both paths)")
    parser.add_argument("--torch-router", action="store_true",
                        help="router softmax + top-k with the model's torch ops instead of kernels.route_topk (both "
                             "paths)")
    parser.add_argument("--reserve-gb", type=float, default=8.0, help="memory kept free for activations/workspace")
    add_kernel_option_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rollout needs a CUDA device")
    with kernels.kernel_options(kernel_options_from(args)):
        run(args)


def run(args: argparse.Namespace) -> None:
    """The long rollouts (--long) or the decode step at each batch, then their table."""
    torch.manual_seed(0)
    s = Shape()
    global FIXED_ROUTING, UNFUSED_ROPE, TORCH_ROUTER
    FIXED_ROUTING, UNFUSED_ROPE, TORCH_ROUTER = args.fixed_routing, args.unfused_rope, args.torch_router
    layers = [Layer(s) for _ in range(args.layers)]
    head = torch.randn(s.vocab, s.dim, device="cuda", dtype=torch.bfloat16) * 0.02
    if args.long:
        rep = Report(["path", "batch", "gen", "step_ms_first", "step_ms_last", "rollout_s", "tok_per_s", "kv_GB",
                      "weights_GB"])
        long_rollout(rep, s, layers, head, args.long, args.prompt, args.reserve_gb)
        tps = {r["path"]: r["tok_per_s"] for r in rep.rows}
        print(f"\n## long rollouts: {args.long} generated tokens after a {args.prompt}-token prompt, largest batch "
              f"that fits, {args.layers} layers measured and scaled to 48, {torch.cuda.get_device_name()}; "
              f"FP4 / BF16 tokens/s = {tps.get('fp4', 0) / max(tps.get('bf16', 1), 1e-9):.2f}\n")
        print(rep.table())
        return
    rep = Report(["path", "batch", "mode", "layers_ms", "step_ms_48", "roofline_ms", "pct_roofline", "weights_GB",
                  "kv_GB", "touched", "tok_per_s", "speedup"])
    for B in args.batches:
        try:
            run_batch(rep, s, layers, B, args.ctx, head)
        except Exception as err:  # noqa: BLE001  (keep the other batches' numbers)
            import traceback

            print(f"# batch {B} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            traceback.print_exc()
            torch.cuda.empty_cache()
    print(f"\n## decode step, qwen3-30b-a3b shape, {args.layers} layers measured and scaled to 48, ctx {args.ctx}, "
          f"{torch.cuda.get_device_name()}\n")
    print(rep.table())


if __name__ == "__main__":
    main()
