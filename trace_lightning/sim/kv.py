"""FP4 KV cache ops: quantize-on-append (one NVFP4 row per token-head) and attention over the packed cache."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.ops import FP4KVLayer
from trace_lightning.quant import NVFP4
from trace_lightning.quant.kv_tiles import from_value_tiles, to_value_tiles
from trace_lightning.quant.words import to_word_layout
from trace_lightning.sim.quantize import quantize_nvfp4_rows


def check_kv_args(layer: FP4KVLayer, k: Tensor, v: Tensor, positions: Tensor) -> None:
    B, Hkv, S, half = layer.k_packed.shape
    if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, Hkv, 2 * half):
        raise ValueError(f"k/v must be [B, T, Hkv, Dh] = [{B}, T, {Hkv}, {2 * half}], got {tuple(k.shape)}")
    if positions.shape != k.shape[:2]:
        raise ValueError(f"positions must be [B, T] = {tuple(k.shape[:2])}, got {tuple(positions.shape)}")


def _write(packed: Tensor, scales: Tensor, glob: Tensor, q: NVFP4, positions: Tensor, words: bool) -> None:
    b, t = (positions >= 0).nonzero(as_tuple=True)
    pos = positions[b, t]
    packed[b, :, pos] = to_word_layout(q.packed[b, t]) if words else q.packed[b, t]
    scales[b, :, pos] = q.scales[b, t]
    glob[b, :, pos] = q.global_scale[b, t]


def kv_append(layer: FP4KVLayer, k: Tensor, v: Tensor, positions: Tensor) -> tuple[NVFP4, NVFP4]:
    """Quantize k, v [B, T, Hkv, Dh] per token-head row and write them at positions [B, T] (< 0: skipped).

    Returns the NVFP4 k and v in [B, T, Hkv, ...] layout, the record of sites `k` and `v`.
    """
    check_kv_args(layer, k, v, positions)
    qk, qv = quantize_nvfp4_rows(k), quantize_nvfp4_rows(v)
    _write(layer.k_packed, layer.k_scales, layer.k_global, qk, positions, layer.words)
    if layer.value_tiles:  # through the stored order: a reference, not fast (every append converts the cache twice)
        packed, scales = from_value_tiles(layer.v_packed, layer.v_scales)
        _write(packed, scales, layer.v_global, qv, positions, False)
        packed, scales = to_value_tiles(packed, scales)
        layer.v_packed.copy_(packed)
        layer.v_scales.copy_(scales)
    else:
        _write(layer.v_packed, layer.v_scales, layer.v_global, qv, positions, layer.words)
    return qk, qv


def fp4_kv_attention(
    q: Tensor, layer: FP4KVLayer, q_positions: Tensor, sm_scale: float, *, compute_dtype: torch.dtype = torch.float32
) -> Tensor:
    """GQA attention of q [B, Hq, T, Dh] over cached keys j <= q_positions[b, t] -> [B, Hq, T, Dh] in q's dtype.

    Dequantizes the cache and takes the softmax in float32; a query with a negative position outputs zeros. Reads
    keys 0 .. max(q_positions) only (outside a CUDA graph capture, where that bound would need a host sync), as the
    kernel reads no key past its query's position: the result does not depend on how long the cache is.
    """
    B, Hq, T, Dh = q.shape
    Hkv, S = layer.k_packed.shape[1], layer.k_packed.shape[2]
    if Hq % Hkv or q_positions.shape != (B, T):
        raise ValueError(f"q {tuple(q.shape)} / q_positions {tuple(q_positions.shape)} do not fit the cache")
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        S = min(S, max(int(q_positions.max()) + 1, 1))
    kd = layer.keys(S).dequantize().to(compute_dtype).repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, S, Dh)
    vd = layer.values(S).dequantize().to(compute_dtype).repeat_interleave(Hq // Hkv, dim=1)
    scores = (q.to(compute_dtype) @ kd.transpose(-1, -2)).float() * sm_scale  # (B, Hq, T, S)
    allowed = torch.arange(S, device=q.device) <= q_positions[:, None, :, None]  # (B, 1, T, S)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    out = (probs.to(compute_dtype) @ vd).float()
    return out.to(q.dtype)
