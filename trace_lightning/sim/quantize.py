"""Quantizers as the kernels compute them: NVFP4 (given or per-row global scale), MXFP4, parity capture.

The bytes are those of trace_lightning.quant (itself bit-exact with torchao 0.18); the Triton twins in
trace_lightning.kernels reproduce its float32 operation order, so both backends give identical bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.quant import MXFP4, NVFP4, row_global_scale
from trace_lightning.quant import quantize_mxfp4 as _quantize_mxfp4
from trace_lightning.quant import quantize_nvfp4 as _quantize_nvfp4


def quantize_nvfp4(x: Tensor, global_scale: Tensor | float | None = None) -> NVFP4:
    """NVFP4 of x [..., K] with no, a scalar, or a broadcastable [..., 1] global scale."""
    return _quantize_nvfp4(x, global_scale)


def quantize_nvfp4_rows(x: Tensor) -> NVFP4:
    """NVFP4 with a per-row global scale amax/2688 (activations, K/V): a row never depends on its batch."""
    return _quantize_nvfp4(x, row_global_scale(x))


def fake_quantize_nvfp4_rows(x: Tensor) -> tuple[Tensor, NVFP4]:
    """(dequantized x in x's dtype, its row-global NVFP4): an activation site's value and its record at once."""
    q = quantize_nvfp4_rows(x)
    return q.dequantize(x.dtype), q


def quantize_mxfp4(x: Tensor, mode: str = "floor") -> MXFP4:
    """MXFP4 of x [..., K] with the FLOOR or RCEIL scale rule."""
    return _quantize_mxfp4(x, mode)


def pack_parity(packed: Tensor) -> Tensor:
    """Parity (E2M1 mantissa) bits of packed codes [..., K/2] -> uint8 [..., K/8].

    Bit i of byte j holds the parity of code 8j + i (little-endian bit order), the compact record.
    """
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"packed must be uint8 with a last dim divisible by 4, got {packed.dtype} {packed.shape}")
    p = packed.reshape(*packed.shape[:-1], -1, 4).to(torch.int32)
    bits = (p & 1) | ((p >> 4) & 1) << 1  # two codes per byte -> 2 bits
    shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.int32)
    return (bits << shifts).sum(-1).to(torch.uint8)
