"""The MoE policy transformer, in one file that reads top to bottom (gpt-fast style).

Rollout and training must run the same arithmetic, so the model has no quantization code of its own:
every quantizable tensor passes through the hook object the caller hands in (see ``hooks.py``), and
routing replay and the KV cache are plain arguments of ``forward``. Projections are small ``Linear``
modules and the routed experts one ``Experts`` module, so a converter can swap them for FP4 kernels.
Shapes: B batch, T new tokens, S cached + new tokens, D model width, Hq/Hkv heads, Dh head width,
E experts, K top-k, I expert width, N = B * T tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trace_lightning.model.config import MoEConfig
from trace_lightning.model.hooks import QuantHook


class KVCacheProtocol(Protocol):
    """What attention needs from the rollout engine's cache."""

    def update(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v (B, T, Hkv, Dh) at positions (B, T); return k_all, v_all (B, S, Hkv, Dh) and the
        boolean mask allowed (B, T, S) of keys each new query may attend to."""
        ...

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float) -> Tensor | None:
        """Optionally store k, v and attend q (B, T, Hq, Dh) on the cache's own form (a fused kernel over a
        packed cache): (B, T, Hq, Dh), or None to fall back to update + SDPA."""
        ...


@dataclass
class ModelOutput:
    """Logits plus the expert ids each layer used, for the rollout record and routing replay."""

    logits: Tensor
    """(B, T, V)"""
    routes: list[Tensor]
    """Per layer, (B, T, K) int64 expert ids in top-k order."""


def _site(hook: QuantHook | None, x: Tensor, layer: int, site: str) -> Tensor:
    return x if hook is None else hook.activation(x, layer=layer, site=site)


class RMSNorm(nn.Module):
    """RMSNorm in fp32, scaled in the input dtype (the Hugging Face order, so bf16 rounds the same)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused: Callable[[Tensor, Tensor, float], Tensor] | None = None
        """The same arithmetic in one launch, (x, weight, eps) -> out, used when no gradient is recorded (it has no
        backward): the rollout engine sets ops.rms_norm on GPU."""

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None and not torch.is_grad_enabled():
            return self.fused(x, self.weight, self.eps)
        # x * rsqrt(mean(x^2) + eps) in float32 by torch's rms_norm: on the CPU the same ops as written out (the same
        # bits, gradients too), on CUDA one kernel forward and one backward where the written-out form launched some
        # twenty between them (a training step is launch-bound: docs/benchmarks.md).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # no cast between the norm and the scale
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (B, T, Dh) for positions (B, T); computed in fp32 each call, so no buffer gets cast to bf16."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions[..., None].float() * inv_freq  # (B, T, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, Dh)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x (B, T, H, Dh)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Linear(nn.Module):
    """A projection whose weight goes through ``hook.weight``; the FP4 converter replaces this module."""

    def __init__(self, in_features: int, out_features: int, *, layer: int, name: str, bias: bool = False) -> None:
        super().__init__()
        self.layer, self.name = layer, name
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, hook: QuantHook | None = None) -> Tensor:
        w = self.weight if hook is None else hook.weight(self.weight, layer=self.layer, name=self.name)
        return F.linear(x, w, self.bias)


class Attention(nn.Module):
    """GQA attention with fused QKV, optional q/k RMSNorm, RoPE and an optional external KV cache."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        c = config
        self.wqkv = Linear(c.dim, c.q_dim + 2 * c.kv_dim, layer=layer, name="attn.wqkv", bias=c.qkv_bias)
        self.wo = Linear(c.q_dim, c.dim, layer=layer, name="attn.wo")
        norm_dims = {"none": None, "head": (c.head_dim, c.head_dim), "full": (c.q_dim, c.kv_dim)}[c.qk_norm]
        self.q_norm = RMSNorm(norm_dims[0], c.norm_eps) if norm_dims else None
        self.k_norm = RMSNorm(norm_dims[1], c.norm_eps) if norm_dims else None
        self.fused_rope: Callable[..., Tensor] | None = None
        """Head norm + RoPE of q or k in one launch, (x, cos, sin, norm weight or None, eps) -> out, the same
        arithmetic, used without autograd for per-head or no q/k norm: the rollout engine sets ops.rope on GPU."""

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], positions: Tensor, mask: Tensor | None,
                cache: KVCacheProtocol | None, hook: QuantHook | None) -> Tensor:
        """x (B, T, D); mask (B, 1, T, T) bool or None for plain causal; returns (B, T, D)."""
        c, (B, T, _) = self.config, x.shape
        x = _site(hook, x, self.layer, "attn_in")
        q, k, v = self.wqkv(x, hook).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, c.n_heads, c.head_dim)  # (B, T, Hq, Dh)
        k = k.view(B, T, c.n_kv_heads, c.head_dim)  # (B, T, Hkv, Dh)
        v = v.view(B, T, c.n_kv_heads, c.head_dim)  # (B, T, Hkv, Dh)
        if self.fused_rope is not None and c.qk_norm != "full" and not torch.is_grad_enabled():
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if c.qk_norm == "head" else (None, None)
            q, k = self.fused_rope(q, *rope, qw, c.norm_eps), self.fused_rope(k, *rope, kw, c.norm_eps)
        else:
            if c.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k = _site(hook, k, self.layer, "k")
        v = _site(hook, v, self.layer, "v")
        attend = getattr(cache, "attend", None)  # optional: caches that can attend on their packed form
        fused = None if attend is None else attend(self.layer, q, k, v, positions, c.head_dim**-0.5)
        if fused is not None:
            y = fused.reshape(B, T, c.q_dim)  # (B, T, Hq*Dh)
        else:
            if cache is not None:
                k, v, allowed = cache.update(self.layer, k, v, positions)  # (B, S, Hkv, Dh) x2, (B, T, S)
                mask = allowed[:, None]  # (B, 1, T, S)
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, enable_gqa=c.n_heads != c.n_kv_heads,
            )  # (B, Hq, T, Dh)
            y = y.transpose(1, 2).reshape(B, T, c.q_dim)  # (B, T, Hq*Dh)
        y = _site(hook, y, self.layer, "attn_out")
        return self.wo(y, hook)


def router_scores(logits: Tensor, scoring: str) -> Tensor:
    """float32 scores of router logits (B, T, E): softmax or sigmoid over the experts."""
    logits = logits.float()
    return logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()


def top_k_gates(logits: Tensor, top_k: int, scoring: str, normalize: bool,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The router without replay on its logits (B, T, E) -> (gates, ids) (B, T, K), best first: the top-k scores,
    optionally divided by their sum, in out_dtype (the reference of the kernels' route_topk)."""
    gates, ids = router_scores(logits, scoring).topk(top_k, dim=-1)  # (B, T, K)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(out_dtype), ids


class Router(nn.Module):
    """Top-k router with fp32 scores; with replayed ids the gates are this router's scores at those ids."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.dim))
        self.fused: Callable[[Tensor, int, str, bool, torch.dtype], tuple[Tensor, Tensor]] | None = None
        """top_k_gates in one launch, the same arithmetic, used without replay and without autograd: the rollout
        engine sets ops.route_topk on GPU."""

    def forward(self, x: Tensor, routed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, D), routed (B, T, K) or None -> gate weights (B, T, K) in x's dtype, ids (B, T, K) int64."""
        c = self.config
        logits = F.linear(x, self.weight)  # (B, T, E)
        if routed is None:
            fused = self.fused is not None and not torch.is_grad_enabled()
            return (self.fused if fused else top_k_gates)(logits, c.top_k, c.router, c.norm_topk_prob, x.dtype)
        if routed.shape != (*x.shape[:-1], c.top_k):
            raise ValueError(f"routed ids have shape {tuple(routed.shape)}, expected {(*x.shape[:-1], c.top_k)}")
        ids = routed.to(device=x.device, dtype=torch.long)
        gates = router_scores(logits, c.router).gather(-1, ids)  # (B, T, K)
        if c.norm_topk_prob:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return gates.to(x.dtype), ids


def _use_grouped_mm(x: Tensor, w: Tensor) -> bool:
    """torch's grouped GEMM: bf16 with aligned shapes on CUDA (the fast kernel), fp32 on CUDA through torch's loop
    over the groups in C++ (the training forward: the same products as a Python loop over experts, whose autograd
    zero-fills the whole expert stack once per expert, 2.2x the micro-step time on medium-moe on an H100), and both
    on the CPU."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type != "cuda":
        return False
    if x.dtype == torch.float32:
        return not torch.cuda.is_current_stream_capturing()  # the loop reads the group offsets back to the host
    return x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0


def grouped_linear(x: Tensor, w: Tensor, counts: Tensor, use_grouped_mm: bool = True) -> Tensor:
    """x (M, in) sorted by expert with counts (E,) rows each, w (E, out, in) -> (M, out); empty experts cost nothing.
    Under autocast both run in its dtype, as F.linear's would (torch's grouped GEMM is not on autocast's list)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if use_grouped_mm and _use_grouped_mm(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    chunks = x.split(counts.tolist())
    outs = [F.linear(chunk, w[e]) for e, chunk in enumerate(chunks) if chunk.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def grouped_experts(x: Tensor, ids: Tensor, gates: Tensor, w13: Tensor, w2: Tensor, hook: QuantHook | None = None,
                    layer: int = 0, use_grouped_mm: bool = True) -> Tensor:
    """SwiGLU experts w13 [E, 2I, D], w2 [E, D, I] on x (B, T, D) routed by ids and gates (B, T, K) -> (B, T, D):
    token-expert pairs sorted by expert, one grouped GEMM each (nothing read back to the host on the grouped path);
    the hook's activation sees moe_down in canonical pair order (token-major, then top-k slot)."""
    (B, T, D), K, I = x.shape, ids.shape[-1], w2.shape[-1]
    flat = ids.reshape(-1)  # (N*K,) canonical order: token-major, then top-k slot
    order = flat.argsort(stable=True)  # (N*K,) canonical pair index, in expert order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # (E,) counts by scatter_add: CUDA bincount reads its max back to the host, which a CUDA graph cannot hold
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    xs = x.reshape(-1, D)[order // K]  # (N*K, D)
    gate, up = grouped_linear(xs, w13, counts, use_grouped_mm).chunk(2, dim=-1)
    h = F.silu(gate) * up  # (N*K, I) expert order
    if hook is not None:
        h = hook.activation(h[inverse].view(B, T, K, I), layer=layer, site="moe_down")
        h = h.reshape(-1, I)[order]
    y = grouped_linear(h, w2, counts, use_grouped_mm)[inverse].view(B, T, K, D)  # canonical order
    return (y * gates[..., None]).sum(dim=2)  # (B, T, D), slots summed in top-k order


class Experts(nn.Module):
    """E stacked SwiGLU experts: w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I]."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        c = config
        self.w13 = nn.Parameter(torch.empty(c.n_experts, 2 * c.moe_intermediate, c.dim))
        self.w2 = nn.Parameter(torch.empty(c.n_experts, c.dim, c.moe_intermediate))
        self.use_grouped_mm = True  # False: loop over the touched experts' sorted slices instead

    def _weights(self, hook: QuantHook | None) -> tuple[Tensor, Tensor]:
        if hook is None:
            return self.w13, self.w2
        return (hook.weight(self.w13, layer=self.layer, name="moe.w13"),
                hook.weight(self.w2, layer=self.layer, name="moe.w2"))

    def forward(self, x: Tensor, ids: Tensor, gates: Tensor, hook: QuantHook | None = None) -> Tensor:
        """Grouped path: x (B, T, D), ids and gates (B, T, K) -> (B, T, D). Token-expert pairs sorted by expert."""
        w13, w2 = self._weights(hook)
        return grouped_experts(x, ids, gates, w13, w2, hook, self.layer, self.use_grouped_mm)

    def forward_reference(self, x: Tensor, ids: Tensor, gates: Tensor, hook: QuantHook | None = None) -> Tensor:
        """Plain loop over all experts with boolean masks; the grouped path must match it."""
        (B, T, D), K, I = x.shape, ids.shape[-1], self.config.moe_intermediate
        w13, w2 = self._weights(hook)
        h = x.new_zeros(B, T, K, I)
        for e in range(self.config.n_experts):
            hit = ids == e  # (B, T, K)
            gate, up = F.linear(x[hit.any(-1)], w13[e]).chunk(2, dim=-1)  # one row per token using e
            h[hit] = F.silu(gate) * up  # a token never picks e twice, so rows map 1:1 to pairs
        if hook is not None:
            h = hook.activation(h, layer=self.layer, site="moe_down")
        y = x.new_zeros(B, T, K, D)
        for e in range(self.config.n_experts):
            hit = ids == e
            y[hit] = F.linear(h[hit], w2[e])
        return (y * gates[..., None]).sum(dim=2)


class SharedExpert(nn.Module):
    """Always-on SwiGLU MLP (Qwen2-MoE), optionally scaled per token by a sigmoid gate."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.w13 = Linear(config.dim, 2 * config.shared_intermediate, layer=layer, name="moe.shared_w13")
        self.w2 = Linear(config.shared_intermediate, config.dim, layer=layer, name="moe.shared_w2")
        self.gate = nn.Parameter(torch.empty(1, config.dim)) if config.shared_expert_gate else None

    def forward(self, x: Tensor, x_gate: Tensor, hook: QuantHook | None) -> Tensor:
        """x (B, T, D) quantized input of the MLP, x_gate (B, T, D) high-precision input of the gate."""
        gate, up = self.w13(x, hook).chunk(2, dim=-1)
        h = _site(hook, F.silu(gate) * up, self.layer, "shared_down")  # (B, T, I_shared)
        y = self.w2(h, hook)  # (B, T, D)
        return y if self.gate is None else torch.sigmoid(F.linear(x_gate, self.gate)) * y


class MoE(nn.Module):
    """Router + routed experts (+ shared expert). The router always sees the unquantized input."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.router = Router(config)
        self.experts = Experts(config, layer)
        self.shared = SharedExpert(config, layer) if config.n_shared_experts else None

    def forward(self, x: Tensor, hook: QuantHook | None, routed: Tensor | None) -> tuple[Tensor, Tensor]:
        """x (B, T, D) -> (B, T, D), expert ids (B, T, K)."""
        gates, ids = self.router(x, routed)  # (B, T, K) x2
        xq = _site(hook, x, self.layer, "moe_in")
        y = self.experts(xq, ids, gates, hook)
        if self.shared is not None:
            y = y + self.shared(xq, x, hook)
        return y, ids


class Block(nn.Module):
    """Pre-norm transformer block: attention then MoE, each with a residual."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe = MoE(config, layer)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], positions: Tensor, mask: Tensor | None,
                cache: KVCacheProtocol | None, hook: QuantHook | None, routed: Tensor | None) -> tuple[Tensor, Tensor]:
        h = x + self.attn(self.attention_norm(x), rope, positions, mask, cache, hook)  # (B, T, D)
        y, ids = self.moe(self.ffn_norm(h), hook, routed)
        return h + y, ids


def attention_mask_from_padding(attention_mask: Tensor) -> Tensor:
    """(B, T) bool, True for real tokens of right-padded rows -> (B, 1, T, T) causal mask without pad keys.
    Pad queries also see themselves, so no row is empty (their outputs are ignored, but must not be NaN)."""
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    allowed = causal & attention_mask.bool()[:, None, :]  # (B, T, T)
    return (allowed | torch.eye(T, dtype=torch.bool, device=attention_mask.device))[:, None]


class Transformer(nn.Module):
    """Decoder-only MoE LM; ``forward(input_ids, ...)`` returns logits (B, T, V) or a ``ModelOutput``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.reset_parameters()

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Transformer:
        return cls(MoEConfig.from_name(name, **overrides))

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from torch's RNG: matrices ~ N(0, init_std), norms 1, biases 0."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, self.config.init_std)
        self.tie_weights()

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: KVCacheProtocol | None = None, hook: QuantHook | None = None,
                routed: list[Tensor] | None = None, return_routes: bool = False,
                logits_at: Tensor | None = None) -> Tensor | ModelOutput:
        """input_ids (B, T). positions (B, T) default 0..T-1 (pass them with a cache). attention_mask (B, T) bool
        marks real tokens of right-padded rows (without a cache; with one, the cache's mask rules). routed: per
        layer (B, T, K) expert ids to replay. Boundary layers of the config run without the hook. logits_at (B,)
        index of the one position per row whose logits are wanted: logits (B, 1, V) instead of (B, T, V) (a
        prefill needs each prompt's last; the full (B, T, V) tensor would dwarf the KV cache at a large vocab)."""
        c, (B, T) = self.config, input_ids.shape
        if routed is not None and len(routed) != c.n_layers:
            raise ValueError(f"routed has {len(routed)} layers, the model has {c.n_layers}")
        if cache is not None and attention_mask is not None:
            raise ValueError("with a cache, padding goes through the mask that cache.update returns")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = attention_mask_from_padding(attention_mask) if attention_mask is not None else None
        x = self.tok_embeddings(input_ids)  # (B, T, D)
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)  # (B, T, Dh) x2
        routes = []
        for i, layer in enumerate(self.layers):
            layer_hook = hook if c.is_quantized_layer(i) else None
            x, ids = layer(x, rope, positions, mask, cache, layer_hook, None if routed is None else routed[i])
            routes.append(ids)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]  # (B, 1, D)
        logits = self.output(self.norm(x))  # (B, T, V) or (B, 1, V)
        return ModelOutput(logits, routes) if return_routes else logits
