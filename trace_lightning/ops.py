"""The one dispatch point between Triton kernels and their CPU twins, plus the FP4 KV cache layout.

`backend_for(device, choice)` returns trace_lightning.kernels or trace_lightning.sim; both expose the same
ops (quantize_nvfp4, quantize_nvfp4_rows, fake_quantize_nvfp4_rows, quantize_mxfp4, quantize_weight, prepared_weight,
pack_parity, fp4_linear, fp4_moe, kv_append, fp4_kv_attention, write_record_slot, rms_norm, rope, route_topk), so
callers write `ops = backend_for(x.device, cfg.backend); ops.fp4_linear(x, w)`.
Backends are imported lazily: this module needs only torch, so CPU-only code never loads Triton.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from trace_lightning.quant import NVFP4
from trace_lightning.quant.kv_tiles import VALUE_TILE_KEYS, from_value_tiles
from trace_lightning.quant.words import from_word_layout

BACKENDS = ("auto", "triton", "sim")
TRITON_MODULE, SIM_MODULE = "trace_lightning.kernels", "trace_lightning.sim"


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1, read by Triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend_for(device: torch.device | str, choice: str = "auto") -> ModuleType:
    """The op module for tensors on `device`: "auto" is Triton on CUDA and the sim elsewhere."""
    if choice not in BACKENDS:
        raise ValueError(f"unknown backend {choice!r}; expected one of {BACKENDS}")
    device = torch.device(device)
    if choice == "sim" or (choice == "auto" and device.type != "cuda"):
        return importlib.import_module(SIM_MODULE)
    if device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"backend 'triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before triton is imported; "
            "use backend 'sim' (or 'auto') on CPU"
        )
    return importlib.import_module(TRITON_MODULE)


def is_triton(ops: ModuleType) -> bool:
    """Whether an op module from backend_for is the Triton one (callers pick fused paths by it)."""
    return ops.__name__ == TRITON_MODULE


@dataclass
class FP4KVLayer:
    """One layer's FP4 KV cache, contiguous per (batch, kv head): NVFP4 rows with per-token-head globals.

    k_packed uint8 [B, Hkv, S, Dh/2], k_scales float8_e4m3fn [B, Hkv, S, Dh/16], k_global float32 [B, Hkv, S, 1],
    and the same for v. Contiguous so that the decode kernel reads each head's keys as one stream. With `words`
    the packed codes are in the kernels' word layout (trace_lightning/quant/words.py), which their fast decoder
    reads with about half the instructions; with `value_tiles` the values' codes and scales are in the value tiles
    of trace_lightning/quant/kv_tiles.py (key pairs per byte, for the attention's P V product; S a multiple of 16),
    whatever `words` says. Both backends write and read every layout.
    """

    k_packed: Tensor
    k_scales: Tensor
    k_global: Tensor
    v_packed: Tensor
    v_scales: Tensor
    v_global: Tensor
    words: bool = False
    value_tiles: bool = False

    def __post_init__(self) -> None:
        if self.value_tiles and self.v_packed.shape[2] % VALUE_TILE_KEYS:
            raise ValueError(f"a cache with value tiles holds a multiple of {VALUE_TILE_KEYS} positions, got "
                             f"{self.v_packed.shape[2]} (FP4KVLayer.allocate rounds max_len up)")

    @classmethod
    def allocate(cls, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str = "cpu", words: bool = False, value_tiles: bool = False) -> FP4KVLayer:
        """Zeroed cache (zero bytes dequantize to 0.0, in every layout); with value_tiles max_len is rounded up to a
        whole number of tiles."""
        if head_dim % 16:
            raise ValueError(f"head_dim must be divisible by 16, got {head_dim}")
        if value_tiles:
            max_len = -(-max_len // VALUE_TILE_KEYS) * VALUE_TILE_KEYS
        shape = (batch, kv_heads, max_len)

        def zeros(last: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(*shape, last, dtype=dtype, device=device)

        return cls(zeros(head_dim // 2, torch.uint8), zeros(head_dim // 16, torch.uint8).view(torch.float8_e4m3fn),
                   zeros(1, torch.float32), zeros(head_dim // 2, torch.uint8),
                   zeros(head_dim // 16, torch.uint8).view(torch.float8_e4m3fn), zeros(1, torch.float32), words,
                   value_tiles)

    def batch_rows(self, start: int, stop: int) -> FP4KVLayer:
        """A view of sequences start..stop (writes land in this cache)."""
        return FP4KVLayer(*(t[start:stop] for t in self.tensors()), words=self.words, value_tiles=self.value_tiles)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.k_packed, self.k_scales, self.k_global, self.v_packed, self.v_scales, self.v_global

    def stored_order(self) -> FP4KVLayer:
        """This cache with its packed codes in stored NVFP4 order (itself when it is; else an exact copy)."""
        if not (self.words or self.value_tiles):
            return self
        k, v = self.keys(), self.values()
        return FP4KVLayer(k.packed, k.scales, k.global_scale, v.packed, v.scales, v.global_scale)

    def stored_keys(self) -> FP4KVLayer:
        """This cache with its keys in stored NVFP4 order and its values as they are (an exact copy of the keys)."""
        if not self.words:
            return self
        k = self.keys()
        return FP4KVLayer(k.packed, k.scales, k.global_scale, self.v_packed, self.v_scales, self.v_global,
                          words=False, value_tiles=self.value_tiles)

    def keys(self, length: int | None = None) -> NVFP4:
        """NVFP4 keys [B, Hkv, length, Dh] in stored order."""
        return self._rows(self.k_packed, self.k_scales, self.k_global, length, self.words)

    def values(self, length: int | None = None) -> NVFP4:
        """NVFP4 values [B, Hkv, length, Dh] in stored order."""
        if self.value_tiles:
            packed, scales = from_value_tiles(self.v_packed, self.v_scales)
            return self._rows(packed, scales, self.v_global, length, False)
        return self._rows(self.v_packed, self.v_scales, self.v_global, length, self.words)

    @staticmethod
    def _rows(packed: Tensor, scales: Tensor, glob: Tensor, length: int | None, words: bool) -> NVFP4:
        n = packed.shape[2] if length is None else length
        packed = packed[:, :, :n]
        return NVFP4(from_word_layout(packed) if words else packed, scales[:, :, :n], glob[:, :, :n])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, Hkv, S, Dh)"""
        B, H, S, half = self.k_packed.shape
        return B, H, S, 2 * half

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize_k(self) -> Tensor:
        """float32 keys [B, Hkv, S, Dh]."""
        return self.keys().dequantize()

    def dequantize_v(self) -> Tensor:
        """float32 values [B, Hkv, S, Dh]."""
        return self.values().dequantize()


__all__ = ["BACKENDS", "FP4KVLayer", "backend_for", "interpreter_enabled"]
