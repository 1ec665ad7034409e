"""Straight-through fake quantization for quantization-aware training.

Forward returns the dequantized FP4 value (plain round-to-nearest with the training side's own
scales, or guided by a rollout record) in x's dtype; backward passes the gradient straight
through wherever the scaled value lay inside the E2M1 range, and blocks it where it was clamped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4, split_blocks
from trace_lightning.quant.e2m1 import E2M1_MAX
from trace_lightning.quant.formats import FP4Format, parse_format
from trace_lightning.quant.guided import guided_quantize


def quantize(x: Tensor, fmt: FP4Format | str, ref: BlockFP4 | None = None, mode: str | None = None) -> BlockFP4:
    """Quantize x in format fmt; with a record `ref`, guided in `mode` ("full" or "parity")."""
    if ref is None:
        if mode is not None:
            raise ValueError(f"guidance mode {mode!r} given without a record")
        return parse_format(fmt).quantize(x)
    return guided_quantize(x, ref, mode or "parity")


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: FP4Format, ref: BlockFP4 | None, mode: str | None) -> Tensor:
        q = quantize(x.detach(), fmt, ref, mode)
        blocks = split_blocks(x.detach(), q.block_size)
        inside = q.scale_input(blocks).abs() <= E2M1_MAX
        ctx.save_for_backward(inside.reshape(x.shape))
        return q.dequantize(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None


def fake_quantize(x: Tensor, fmt: FP4Format | str, ref: BlockFP4 | None = None, mode: str | None = None) -> Tensor:
    """Dequantized FP4 value of x (optionally guided by `ref`), with a straight-through gradient."""
    return _FakeQuantize.apply(x, parse_format(fmt), ref, mode)
