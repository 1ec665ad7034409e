"""KV caches behind the model's cache protocol: ``update(layer, k, v, positions) -> (k_all, v_all, allowed)``.

Each row of the batch writes its keys at its own positions, so ragged prompts need no left padding: pad
tokens of a right-padded prefill sit at positions the row's decode steps overwrite before any query of
that row can see them (a query at position p attends to keys 0..p only). The engine sets ``visible``,
a host-side bound on the positions written so far, so attention reads a growing window, not max_len.

The FP4 cache stores NVFP4 rows per token-head (packed codes, E4M3 block scales, fp32 row global) in
``ops.FP4KVLayer`` and quantizes through ``ops.kv_append``; MXFP4 rows are kept the same way in a
position-indexed buffer. It returns the window dequantized in the compute dtype, which is numerically
what fused attention over the packed cache computes. With ``fused_attention`` (the engine's default on every
backend) NVFP4 layers skip that window: ``attend`` runs ``ops.fp4_kv_attention`` on the packed
cache itself, so a decode step reads 4.5-bit keys and values instead of materializing bf16 copies.
Boundary (bf16) layers keep a dense cache.

Continuous batching (rollout/slots.py) indexes the cache by slot and refills a slot with a new prompt while
the other slots keep decoding. The model's forward writes cache rows by batch index, and ``ops.kv_append``
writes rows 0..B-1 of its store, so a refill prefills its k prompts into a fresh k-row cache and
``copy_rows`` copies those whole rows (every position, every layer, every layout: plain bytes) into the
slots' rows. That is exact, and the refilled row then equals a fresh cache's row. Stale rows would be
harmless anyway: a query at position p reads keys 0..p only (``allowed`` masks the window before SDPA; the
sim's ``fp4_kv_attention`` masks scores to -inf, and the Triton kernel never loads keys past p), and the
prefill writes positions 0..len-1 before any decode step of that sequence reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import Tensor

from trace_lightning.model.config import MoEConfig
from trace_lightning.ops import FP4KVLayer
from trace_lightning.quant import BlockFP4, FP4Format
from trace_lightning.rollout.capture import Recorder, RowBuffer, batch_rows, quantize_rows


class KVCache:
    """Dense cache in the compute dtype: per layer k, v [B, S, Hkv, Dh]."""

    def __init__(self, config: MoEConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 layers: Iterable[int] | None = None) -> None:
        self.config, self.batch, self.max_len, self.dtype = config, batch, max_len, dtype
        self.visible = max_len
        """Keys 0 .. visible-1 are returned (the engine keeps it >= 1 + the largest position written)."""
        shape = (batch, max_len, config.n_kv_heads, config.head_dim)
        dense = range(config.n_layers) if layers is None else layers
        self.k: dict[int, Tensor] = {i: torch.zeros(shape, dtype=dtype, device=device) for i in dense}
        self.v: dict[int, Tensor] = {i: torch.zeros(shape, dtype=dtype, device=device) for i in dense}

    def allowed(self, positions: Tensor) -> Tensor:
        """(B, T) query positions -> (B, T, visible) bool: key j is visible to a query at p iff j <= p."""
        keys = torch.arange(self.visible, device=positions.device)
        return keys <= positions[..., None]

    def update(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows, n = batch_rows(positions), self.visible
        self.k[layer][rows, positions] = k.to(self.dtype)
        self.v[layer][rows, positions] = v.to(self.dtype)
        return self.k[layer][:, :n], self.v[layer][:, :n], self.allowed(positions)

    def copy_rows(self, source: KVCache, rows: Tensor) -> None:
        """Overwrite rows (k,) of this cache with the whole rows 0..k-1 of ``source`` (same layers and layout)."""
        for mine, theirs in ((self.k, source.k), (self.v, source.v)):
            for layer, t in mine.items():
                t[rows] = theirs[layer]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float) -> Tensor | None:
        """Store k, v and return attention (B, T, Hq, Dh) computed on the stored form, or None when this layer
        has no fused kernel (the model then calls update and runs SDPA)."""
        return None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class FP4KVCache(KVCache):
    """FP4 cache (NVFP4 through the ops backend, or MXFP4) for quantized layers, dense for boundary layers."""

    def __init__(self, config: MoEConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 ops: ModuleType, fmt: FP4Format, recorder: Recorder | None = None,
                 fused_attention: bool = False) -> None:
        fp4_layers = [i for i in range(config.n_layers) if config.is_quantized_layer(i)]
        dense = [i for i in range(config.n_layers) if i not in fp4_layers]
        super().__init__(config, batch, max_len, dtype, device, layers=dense)
        self.ops, self.fmt, self.recorder = ops, fmt, recorder
        self.fused_attention = fused_attention and fmt.kind == "nvfp4"
        if fmt.kind == "nvfp4":
            words = self.fused_attention and ops.prefers_word_layout(dtype, device, cache=True)
            tiles = self.fused_attention and ops.prefers_value_tiles(dtype, device)
            self.layers: dict[int, FP4KVLayer] = {
                i: FP4KVLayer.allocate(batch, config.n_kv_heads, max_len, config.head_dim, device=device, words=words,
                                       value_tiles=tiles)
                for i in fp4_layers}
        else:
            self.mx: dict[int, tuple[RowBuffer, RowBuffer]] = {
                i: (RowBuffer(batch, max_len), RowBuffer(batch, max_len)) for i in fp4_layers}

    def update(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if layer in self.k:
            return super().update(layer, k, v, positions)
        n = self.visible
        if self.fmt.kind == "nvfp4":
            store = self.layers[layer]
            qk, qv = self.ops.kv_append(store, k, v, positions)
            k_all = store.keys(n).dequantize(self.dtype).transpose(1, 2)
            v_all = store.values(n).dequantize(self.dtype).transpose(1, 2)
        else:
            kbuf, vbuf = self.mx[layer]
            qk = quantize_rows(lambda x: self.ops.quantize_mxfp4(x, self.fmt.mx_mode), k)
            qv = quantize_rows(lambda x: self.ops.quantize_mxfp4(x, self.fmt.mx_mode), v)
            kbuf.write(qk, positions)
            vbuf.write(qv, positions)
            k_all, v_all = kbuf.window(n).dequantize(self.dtype), vbuf.window(n).dequantize(self.dtype)
        self._record(layer, qk, qv)
        return k_all, v_all, self.allowed(positions)  # (B, n, Hkv, Dh) x2, (B, T, n)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float) -> Tensor | None:
        if not self.fused_attention or layer in self.k:
            return None
        store = self.layers[layer]
        self._record(layer, *self.ops.kv_append(store, k, v, positions))
        out = self.ops.fp4_kv_attention(q.transpose(1, 2).contiguous(), store, positions, scale)  # (B, Hq, T, Dh)
        return out.transpose(1, 2)

    def copy_rows(self, source: KVCache, rows: Tensor) -> None:
        assert isinstance(source, FP4KVCache) and source.fmt == self.fmt
        super().copy_rows(source, rows)
        if self.fmt.kind == "nvfp4":
            pairs = [(t, s) for i in self.layers for t, s in zip(self.layers[i].tensors(), source.layers[i].tensors(),
                                                                 strict=True)]
        else:
            pairs = [(self._allocated(mine, theirs).buffers[name], theirs.buffers[name])
                     for i in self.mx for mine, theirs in zip(self.mx[i], source.mx[i], strict=True)
                     for name in theirs.buffers]
        for t, s in pairs:  # 1-byte floats (E4M3 scales) as bytes: indexed writes work on every device
            bytewise = t.is_floating_point() and t.element_size() == 1
            (t.view(torch.uint8) if bytewise else t)[rows] = s.view(torch.uint8) if bytewise else s

    @staticmethod
    def _allocated(mine: RowBuffer, theirs: RowBuffer) -> RowBuffer:
        """mine, with buffers allocated like theirs (a RowBuffer allocates on its first write)."""
        if mine.template is None and theirs.template is not None:
            mine._allocate(theirs.template)
        return mine

    def _record(self, layer: int, qk: BlockFP4, qv: BlockFP4) -> None:
        """The k / v sites' FP4 rows, as written to the cache, into the rollout record."""
        if self.recorder is not None:
            self.recorder.observe(qk, layer=layer, site="k")
            self.recorder.observe(qv, layer=layer, site="v")

    def nbytes(self) -> int:
        dense = super().nbytes()
        if self.fmt.kind == "nvfp4":
            return dense + sum(layer.nbytes() for layer in self.layers.values())
        return dense + sum(t.numel() * t.element_size() for pair in self.mx.values() for buf in pair
                           for t in buf.buffers.values())
