"""The quantization hook: the one object through which the model exposes every quantizable tensor.

Rollout (FP4 + record), training (guided fake-quant) and the BF16 reference run the same model code;
they differ only in the hook object they pass to ``Transformer.forward``. There are no globals and no
flags in the model: a site is a call ``hook.activation(x, layer=l, site=s)`` and a weight is a call
``hook.weight(w, layer=l, name=n)``. Boundary layers (``MoEConfig.bf16_first_layers/last_layers``) never
call the hook.

Activation sites, all with (B, T, ...) leading dims so that rows line up with token positions:

========== ======================== ==========================================================
site       shape                    what
========== ======================== ==========================================================
attn_in    (B, T, D)                input of the fused QKV projection
k, v       (B, T, Hkv, Dh)          keys after k-norm and RoPE, values, as the KV cache stores
                                    them (one quantization row per token-head); called before
                                    ``cache.update``
attn_out   (B, T, Hq * Dh)          input of the output projection
moe_in     (B, T, D)                input of the routed and shared experts' gate/up projections
moe_down   (B, T, top_k, I)         input of the experts' down projection, one row per routed
                                    token-expert pair, token-major then top-k slot order
shared_down (B, T, I_shared)        input of the shared expert's down projection (only families
                                    with shared experts, e.g. Qwen2-MoE)
========== ======================== ==========================================================

Weights passed to ``hook.weight`` (router gate, embeddings, norms, lm_head stay high precision):
``attn.wqkv`` [(Hq + 2 Hkv) Dh, D], ``attn.wo`` [D, Hq Dh], ``moe.w13`` [E, 2I, D] (gate rows, then up rows),
``moe.w2`` [E, D, I], ``moe.shared_w13`` [2 I_shared, D], ``moe.shared_w2`` [D, I_shared].
"""

from __future__ import annotations

from torch import Tensor

SITES: tuple[str, ...] = ("attn_in", "k", "v", "attn_out", "moe_in", "moe_down", "shared_down")
WEIGHTS: tuple[str, ...] = ("attn.wqkv", "attn.wo", "moe.w13", "moe.w2", "moe.shared_w13", "moe.shared_w2")


class QuantHook:
    """Identity hook; subclass it to fake-quantize, guide or record. Must return a tensor of the input's shape."""

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        return x

    def weight(self, w: Tensor, *, layer: int, name: str) -> Tensor:
        return w
