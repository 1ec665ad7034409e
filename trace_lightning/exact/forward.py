"""The one forward both sides of trace_exact run: the rollout engine (prefill and decode over the FP4 KV cache)
and the training step (whole sequences, with autograd), on the invariant arithmetic of ``arith.py``.

It reads the weights of a ``Transformer`` as it finds them: FP4 modules of the engine's converter (their NVFP4
weights), or the trainer's master weights, quantized here with the one weight quantizer (``quantize_weight``, the
converter's) and a straight-through gradient. Activations and K/V are quantized per row as the rollout does, so a
token's codes never depend on its batch; the rollout then computes what training recomputes, bit for bit, and
needs no record. Everything that is not FP4 is rounded to the compute dtype where the model's own forward would
hold it in that dtype. NVFP4 with FP4 weights, activations and KV cache only (the rollout's default precision).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from trace_lightning.exact import arith
from trace_lightning.model.model import ModelOutput, Transformer, rope_cos_sin
from trace_lightning.quant import NVFP4, quantize_weight, row_global_scale
from trace_lightning.quant import quantize_nvfp4 as _quantize_nvfp4
from trace_lightning.quant.words import canonical
from trace_lightning.sim._weights import row_globals

if TYPE_CHECKING:
    from trace_lightning.rollout.cache import KVCache


KERNELS = ("torch", "triton")
"""What computes the exact forward's quantizer, cache append and GEMMs: torch ops (the sim's row quantizer and
append, float64 FP4 GEMMs, tree GEMMs; any device) or Triton kernels with the same bits (kernels.quantize_nvfp4_rows,
kernels.kv_append, kernels/exact.py's GEMMs)."""


def exact_kernels_for(backend: str) -> str:
    """The exact forward's kernels for an op backend choice (BACKENDS): Triton's only when asked by name ("auto"
    keeps the torch path, measured on the GPU); the engine and the fit's setup both decide by this."""
    return "triton" if backend == "triton" else "torch"


def quantize_rows(x: Tensor) -> NVFP4:
    """NVFP4 of x [..., K] with a per-row global scale (what the rollout's activation hook and FP4 cache store)."""
    return _quantize_nvfp4(x, row_global_scale(x))


@functools.lru_cache(maxsize=8)
def rope_table(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 cos, sin [length, Dh] for positions 0..length-1, computed once: every call reads the same bits,
    whatever positions and batch it serves (an elementwise op's vector loop could treat a tail differently)."""
    positions = torch.arange(length, device=device)[None]
    cos, sin = rope_cos_sin(positions, head_dim, theta, torch.float32)
    return cos[0], sin[0]


class ExactForward:
    """One forward of `model` (B, T tokens at `positions`) in `compute_dtype`: over `cache` (the engine) or over
    the whole right-padded sequences of `attention_mask` (training)."""

    def __init__(self, model: Transformer, compute_dtype: torch.dtype, fmt: str = "nvfp4", kernels: str = "torch"
                 ) -> None:
        if fmt != "nvfp4":
            raise ValueError(f"trace_exact computes NVFP4 only (integer-exact GEMMs need E4M3 scales), got {fmt!r}")
        if kernels not in KERNELS:
            raise ValueError(f"unknown exact kernels {kernels!r}; expected one of {KERNELS}")
        self.model, self.config, self.fmt = model, model.config, fmt
        self.compute_dtype, self.kernels = compute_dtype, kernels
        # the steps the two choices compute alike; None: the torch path's own (the cache's append, integer GEMMs)
        self._quantize_rows: Callable[[Tensor], NVFP4] = quantize_rows
        self._tree_matmul: Callable[[Tensor, Tensor], Tensor] = arith.tree_matmul
        self._tree_bmm: Callable[[Tensor, Tensor], Tensor] = arith.tree_bmm
        self._fp4_gemm: Callable[..., Tensor] | None = None
        self._kv_append: Callable[..., object] | None = None
        if kernels == "triton":  # Triton: imported where it runs
            from trace_lightning import kernels as triton_ops
            from trace_lightning.kernels import exact as exact_kernels

            self._quantize_rows, self._kv_append = triton_ops.quantize_nvfp4_rows, triton_ops.kv_append
            self._tree_matmul, self._tree_bmm = exact_kernels.exact_tree_matmul, exact_kernels.exact_tree_bmm
            self._fp4_gemm = exact_kernels.exact_fp4_gemm
        self._held: dict[tuple[int, str], tuple[tuple[int, int, int], Tensor, Tensor]] = {}
        """The engine's FP4 weights as integers, by module and key, while their tensors' versions hold."""

    def rnd(self, x: Tensor) -> Tensor:
        """x rounded to the compute dtype, kept in float32 for the next op."""
        return x if self.compute_dtype == torch.float32 else x.to(self.compute_dtype).float()

    def dense(self, x: Tensor, w: Tensor) -> Tensor:
        """x [..., K] @ w [N, K].T, float32, each output a halving tree over K (arith.dense_linear)."""
        return arith.dense_linear(x, w, self._tree_matmul)

    def param(self, p: Tensor) -> Tensor:
        """A high-precision parameter as the engine holds it (cast to the compute dtype), in float32."""
        return self.rnd(p.float())

    # ---- projections --------------------------------------------------------------------------------
    def weight(self, module: nn.Module, key: str) -> tuple[NVFP4, Tensor | None]:
        """(NVFP4 [..., N, K], straight-through values or None) of a Linear / FP4Linear weight ("weight") or an
        Experts / FP4Experts stack ("w13", "w2")."""
        held = getattr(module, "q", None)
        if held is None:  # the trainer's master weight, quantized by the converter's quantizer
            w = getattr(module, key)
            q = quantize_weight(w.detach(), self.fmt)
            return q, arith.straight_through(w, q)
        return canonical(held[key] if isinstance(held, dict) else held), None  # the engine's, from its last sync

    def integers(self, module: nn.Module, key: str, w: NVFP4, held: bool) -> tuple[Tensor, Tensor]:
        """(FP4 integers [..., N, K], float32 row globals [..., N]) of the module's weight w for the torch GEMMs; an
        engine's (`held`) kept while its tensors' versions hold (a weight sync overwrites the codes in place)."""
        if not held:
            return arith.fp4_integers(w), row_globals(w)
        version = (w.packed._version, w.scales._version, w.packed.data_ptr())
        kept = self._held.get((id(module), key))
        if kept is None or kept[0] != version:
            kept = version, arith.fp4_integers(w), row_globals(w)
            self._held[(id(module), key)] = kept
        return kept[1], kept[2]

    def fp4_product(self, module: nn.Module, key: str, rows: Tensor, counts: Tensor | None = None) -> Tensor:
        """rows [P, K] quantized per row, through the module's FP4 weight (a stack of groups with `counts` rows each)
        -> float32 [P, N]: the exact product, by torch's float64 GEMMs or the Triton kernel (the same bits)."""
        w, w_value = self.weight(module, key)
        value, xq = self.fp4_rows(rows)
        if self._fp4_gemm is not None:
            gemm = self._fp4_gemm
            return arith.exact_product(lambda: gemm(xq, w, counts), value, w_value, counts)
        ints, globals_ = self.integers(module, key, w, held=w_value is None)
        if counts is None:
            return arith.fp4_linear(value, xq, w_value, ints, globals_)
        return arith.grouped_fp4_linear(value, xq, w_value, ints, globals_, counts)

    def fp4_rows(self, x: Tensor) -> tuple[Tensor, NVFP4]:
        """(straight-through values for the backward, NVFP4) of activation rows x [M, K]; without a gradient the
        values are never read (the GEMM reads the codes), so x stands in for them."""
        q = self._quantize_rows(x.detach().contiguous())
        return (arith.straight_through(x, q) if x.requires_grad else x), q

    def linear(self, module: nn.Module, x: Tensor, quantized: bool) -> Tensor:
        """x (..., K) -> (..., N) through a projection: W4A4 in quantized layers, dense tree GEMM otherwise."""
        rows = x.reshape(-1, x.shape[-1])
        if quantized:
            y = self.fp4_product(module, "weight", rows)
        else:
            y = self.dense(rows, self.param(module.weight))
        y = self.rnd(y).view(*x.shape[:-1], -1)
        return y if module.bias is None else self.rnd(y + self.param(module.bias))

    # ---- blocks -------------------------------------------------------------------------------------
    def norm(self, module: nn.Module, x: Tensor) -> Tensor:
        return arith.rms_norm(x, self.param(module.weight), module.eps, self.rnd)

    def attention(self, i: int, attn: nn.Module, x: Tensor, positions: Tensor, allowed: Tensor | None,
                  cache: KVCache | None) -> Tensor:
        c, (B, T, _) = self.config, x.shape
        quantized = c.is_quantized_layer(i)
        q, k, v = self.linear(attn.wqkv, x, quantized).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        if c.qk_norm == "full":
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
        q, k, v = (t.reshape(B, T, -1, c.head_dim) for t in (q, k, v))  # (B, T, H, Dh)
        if c.qk_norm == "head":
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
        cos, sin = (self.rnd(t[positions])[:, :, None] for t in rope_table(c.max_seq_len, c.head_dim, c.rope_theta,
                                                                          x.device))
        q, k = (self.rnd(self.rnd(t * cos) + self.rnd(torch.cat((-t[..., c.head_dim // 2:], t[..., :c.head_dim // 2]),
                                                                  dim=-1) * sin)) for t in (q, k))
        k_all, v_all, allowed = self.keys_values(i, k, v, positions, allowed, cache, quantized)
        y = self.rnd(arith.attention(q, k_all, v_all, allowed, c.head_dim**-0.5, self._tree_bmm))
        y = y.reshape(B, T, c.q_dim)
        return self.linear(attn.wo, y, quantized)

    def keys_values(self, i: int, k: Tensor, v: Tensor, positions: Tensor, allowed: Tensor | None,
                    cache: KVCache | None, quantized: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values every query may read, (B, S, Hkv, Dh) float32, and allowed (B, T, S): from the FP4 cache
        (the engine) or this forward's own (training), as the same per token-head NVFP4 values."""
        if cache is None:
            if quantized:
                k, v = (arith.straight_through(t, self._quantize_rows(t.detach().contiguous())) for t in (k, v))
            assert allowed is not None
            return k, v, allowed
        if quantized and i in getattr(cache, "layers", {}):  # an NVFP4 layer of the FP4 cache
            store, n = cache.layers[i], cache.visible
            (self._kv_append or cache.ops.kv_append)(store, k, v, positions)  # Triton's: no host read, graph-safe
            k_all = store.keys(n).dequantize(torch.float32).transpose(1, 2)
            v_all = store.values(n).dequantize(torch.float32).transpose(1, 2)
            return k_all, v_all, cache.allowed(positions)
        k_all, v_all, seen = cache.update(i, k, v, positions)
        return k_all.float(), v_all.float(), seen

    def moe(self, i: int, moe: nn.Module, x: Tensor, routed: Tensor | None) -> tuple[Tensor, Tensor]:
        c, quantized = self.config, self.config.is_quantized_layer(i)
        scores = self.dense(x, self.param(moe.router.weight))  # (B, T, E)
        scores = self.rnd(scores).softmax(dim=-1) if c.router == "softmax" else self.rnd(scores).sigmoid()
        if routed is None:
            gates, ids = scores.topk(c.top_k, dim=-1)
        else:
            ids = routed.to(device=x.device, dtype=torch.long)
            gates = scores.gather(-1, ids)
        if c.norm_topk_prob:
            total = gates[..., 0]
            for slot in range(1, c.top_k):  # a fixed order
                total = total + gates[..., slot]
            gates = gates / total[..., None]
        gates = self.rnd(gates)
        y = self.experts(moe.experts, x, ids, gates, quantized)
        if moe.shared is not None:
            h = self.linear(moe.shared.w13, x, quantized)
            gate, up = h.chunk(2, dim=-1)
            s = self.linear(moe.shared.w2, self.rnd(torch.nn.functional.silu(gate) * up), quantized)
            if moe.shared.gate is not None:
                s = self.rnd(torch.sigmoid(self.rnd(self.dense(x, self.param(moe.shared.gate)))) * s)
            y = self.rnd(y + s)
        return y, ids

    def experts(self, experts: nn.Module, x: Tensor, ids: Tensor, gates: Tensor, quantized: bool) -> Tensor:
        """Routed SwiGLU experts, one expert's pairs at a time (a pair's result does not depend on its group)."""
        (B, T, D), K = x.shape, ids.shape[-1]
        flat = ids.reshape(-1)  # (N*K,) token-major pairs
        order = flat.argsort(stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        rows = x.reshape(-1, D)[order // K]  # (N*K, D) in expert order
        # (E,) counts by scatter_add: CUDA's bincount reads its max back to the host
        counts = torch.zeros(self.config.n_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        if quantized:  # every expert's rows in one exact grouped GEMM a projection
            h = self._swiglu(self.fp4_product(experts, "w13", rows, counts))
            y = self.fp4_product(experts, "w2", h, counts)
        else:
            project, split = self._projector(experts), counts.tolist()
            h = torch.cat([self._swiglu(project("w13", e, part)) for e, part in enumerate(rows.split(split))])
            y = torch.cat([project("w2", e, part) for e, part in enumerate(h.split(split))])
        y = self.rnd(y)[inverse].view(B, T, K, D)
        out = y[:, :, 0] * gates[..., 0:1]
        for slot in range(1, K):  # a fixed order
            out = out + y[:, :, slot] * gates[..., slot : slot + 1]
        return self.rnd(out)

    def _swiglu(self, gu: Tensor) -> Tensor:
        gate, up = self.rnd(gu).chunk(2, dim=-1)
        return self.rnd(torch.nn.functional.silu(gate) * up)

    def _projector(self, experts: nn.Module) -> Callable[[str, int, Tensor], Tensor]:
        """(key, expert, rows [n, K]) -> rows [n, N] through that expert's dense w13 or w2 (an unquantized layer)."""
        dense = {key: self.param(getattr(experts, key)) for key in ("w13", "w2")}
        return lambda key, e, part: self.dense(part, dense[key][e]) if part.shape[0] else part.new_zeros(
            0, dense[key].shape[-2])

    # ---- the model ----------------------------------------------------------------------------------
    def __call__(self, ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                 cache: KVCache | None = None, routed: list[Tensor] | None = None,
                 logits_at: Tensor | None = None) -> ModelOutput:
        """Logits (B, T, V) (or (B, 1, V) at logits_at) and each layer's routes, as Transformer.forward."""
        m, (B, T) = self.model, ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        allowed = None
        if cache is None:  # causal over the row's real keys; a pad query sees itself (no empty row)
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
            real = attention_mask.bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
            allowed = (causal & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=ids.device)
        x = self.param(m.tok_embeddings.weight)[ids]  # (B, T, D)
        routes = []
        for i, block in enumerate(m.layers):
            h = self.rnd(x + self.attention(i, block.attn, self.norm(block.attention_norm, x), positions, allowed,
                                            cache))
            y, layer_ids = self.moe(i, block.moe, self.norm(block.ffn_norm, h), None if routed is None else routed[i])
            x = self.rnd(h + y)
            routes.append(layer_ids)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]  # (B, 1, D)
        logits = self.rnd(self.dense(self.norm(m.norm, x), self.param(m.output.weight)))
        return ModelOutput(logits.to(self.compute_dtype), routes)
