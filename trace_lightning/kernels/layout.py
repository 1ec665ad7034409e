"""Where the Triton kernels read NVFP4 in their word layout and tiles (trace_lightning/quant/words.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.kernels._common import fast_dequant
from trace_lightning.kernels.quantize import quantize_weight
from trace_lightning.quant import NVFP4, BlockFP4, FP4Format, parse_format
from trace_lightning.quant.words import WordNVFP4, from_word_layout, tileable


def prefers_word_layout(dtype: torch.dtype, device: torch.device | str, cache: bool = False) -> bool:
    """Whether the kernels decode the word layout on their fast path for this compute dtype and device (the
    packed bf16x2 PTX decoder: CUDA, bf16); elsewhere they read the stored order.

    The KV cache (`cache`) takes it wherever the weights do (H200: attention -6%, long 16K rollouts 2.66 -> 2.77x
    BF16, H200 2026-12-03); the argument stays for the ops protocol the sim shares."""
    return fast_dequant(dtype, torch.device(device))


def prefers_value_tiles(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the FP4 KV cache holds its values in value tiles (trace_lightning/quant/kv_tiles.py): where the fast
    decoder runs. The decode attention then takes each V tile as its MMA operand straight from the decoder instead
    of transposing it through shared memory (H200, B=250 / 16K: 43 -> 65% of 4.25 TB/s, 2026-12-04)."""
    return fast_dequant(dtype, torch.device(device))


def prepare_weight(q: NVFP4, compute_dtype: torch.dtype) -> NVFP4:
    """The weight as the Triton GEMMs read it fastest: the word layout where the packed bf16x2 decoder runs
    (CUDA, bf16 compute, last dim divisible by 4 bytes), in tiles where its shape splits into them; q unchanged
    elsewhere."""
    words, tiled = _weight_layout(tuple(q.packed.shape), compute_dtype, q.packed.device)
    if type(q) is not NVFP4 or not words:
        return q
    return WordNVFP4.from_stored(q, tiled=tiled)


def prepared_weight(w: Tensor, fmt: FP4Format | str, compute_dtype: torch.dtype) -> BlockFP4:
    """prepare_weight(quantize_weight(w, fmt)), the layout written by the quantizing launch itself: a weight sync
    re-quantizes every FP4 weight, and permuting its bytes and tiles afterwards took ~30 torch ops a tensor."""
    fmt = parse_format(fmt)
    words, tiled = _weight_layout((*w.shape[:-1], w.shape[-1] // 2), compute_dtype, w.device)
    return quantize_weight(w, fmt, word_layout=words and fmt.kind == "nvfp4", tiled=tiled and fmt.kind == "nvfp4")


def _weight_layout(packed_shape: tuple[int, ...], compute_dtype: torch.dtype,
                   device: torch.device) -> tuple[bool, bool]:
    """(word layout, tiles) of a GEMM weight whose packed codes have this shape."""
    words = prefers_word_layout(compute_dtype, device) and packed_shape[-1] % 4 == 0
    return words, words and tileable(packed_shape)


def readable_weight(q: NVFP4, fast: bool) -> tuple[NVFP4, bool, bool]:
    """(weight, in word layout, in tiles) for a GEMM launch: a word-layout weight goes to the kernel as it is where
    the fast decoder runs; elsewhere its bits go back to the stored order (exact) and its tiles stay."""
    if not isinstance(q, WordNVFP4):
        return q, False, False
    if fast:
        return q, True, q.tiled
    return NVFP4(from_word_layout(q.packed), q.scales, q.global_scale), False, q.tiled
