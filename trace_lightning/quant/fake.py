"""Straight-through fake quantization for quantization-aware training.

Forward returns the dequantized FP4 value (plain round-to-nearest with the training side's own
scales, or guided by a rollout record) in x's dtype; backward passes the gradient straight
through wherever the scaled value lay inside the E2M1 range, and blocks it where it was clamped.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4, split_blocks
from trace_lightning.quant.e2m1 import E2M1_MAX
from trace_lightning.quant.formats import FP4Format, parse_format, quantize_weight
from trace_lightning.quant.guided import guided_quantize


def quantize(x: Tensor, fmt: FP4Format | str, ref: BlockFP4 | None = None, mode: str | None = None) -> BlockFP4:
    """Quantize x in format fmt; with a record `ref`, guided in `mode` ("full" or "parity")."""
    if ref is None:
        if mode is not None:
            raise ValueError(f"guidance mode {mode!r} given without a record")
        return parse_format(fmt).quantize(x)
    return guided_quantize(x, ref, mode or "parity")


def fake_quantized(x: Tensor, fmt: FP4Format, ref: BlockFP4 | None = None,
                   mode: str | None = None) -> tuple[Tensor, Tensor]:
    """(dequantized FP4 value of x in x's dtype, where the scaled x lay inside E2M1's range): what the straight-through
    estimate needs, computed without a gradient. On a GPU one fused kernel computes it (trace_lightning.kernels
    .fake_quant, bit for bit reference_fake_quantized's) where it applies; the reference otherwise."""
    if _fused_wanted(x):
        from trace_lightning.kernels.fake_quant import fused_fake_quantized  # Triton: imported where it runs

        fused = fused_fake_quantized(x, fmt, ref, mode)
        if fused is not None:
            return fused
    return reference_fake_quantized(x, fmt, ref, mode)


def _fused_wanted(x: Tensor) -> bool:
    """Whether to try the fused kernel: on CUDA tensors (tests set it for the CPU, under Triton's interpreter)."""
    return x.is_cuda


def reference_fake_quantized(x: Tensor, fmt: FP4Format, ref: BlockFP4 | None = None,
                             mode: str | None = None) -> tuple[Tensor, Tensor]:
    """fake_quantized from the quantizer's own torch ops (the definition the fused kernel is tested against)."""
    q = quantize(x, fmt, ref, mode)
    inside = q.scale_input(split_blocks(x, q.block_size)).abs() <= E2M1_MAX
    return q.dequantize(x.dtype), inside.reshape(x.shape)


def own_rounding(x: Tensor, fmt: FP4Format) -> BlockFP4:
    """x's own round-to-nearest quantization in `fmt`, its NVFP4 codes by the Triton quantizer where the fused kernels
    run (the same bytes as the reference's)."""
    if not _fused_wanted(x):
        return fmt.quantize(x)
    from trace_lightning.kernels import quantize_nvfp4  # Triton: imported where it runs

    return fmt.quantize(x, nvfp4=quantize_nvfp4)


def with_own_rounding(ref: BlockFP4, x: Tensor, recorded: Tensor, fmt: FP4Format) -> BlockFP4:
    """The record `ref` where `recorded` (x.shape[:-1]) and x's own round-to-nearest codes, scales and globals
    elsewhere. Guided rounding to that is plain rounding at the unrecorded rows, in parity mode too (no code of the
    RNE code's parity lies nearer than it), so one guided pass replaces a guided pass, a plain pass and a select."""
    own = own_rounding(x, fmt)
    lead = tuple(x.shape[:-1])

    def pick(mine: Tensor | None, theirs: Tensor | None) -> Tensor | None:
        if mine is None or theirs is None:
            return mine
        mine, theirs = (torch.broadcast_to(t, (*lead, t.shape[-1])) for t in (mine, theirs))
        if mine.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):  # scales: select their bytes
            return torch.where(recorded[..., None], mine.view(torch.uint8), theirs.view(torch.uint8)).view(mine.dtype)
        return torch.where(recorded[..., None], mine, theirs)

    fields = {"packed": pick(ref.packed, own.packed), "scales": pick(ref.scales, own.scales)}
    if hasattr(ref, "global_scale"):
        fields["global_scale"] = pick(ref.global_scale, own.global_scale)
    return replace(ref, **fields)


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized value; backward: the gradient where the scaled input lay inside the E2M1 range,
    blocked where it was clamped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, inside: Tensor) -> Tensor:
        ctx.save_for_backward(inside)
        ctx.x_dtype = x.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inside,) = ctx.saved_tensors
        # One pass, no float copy of the mask; a value kept in autocast's dtype hands x its own dtype's gradient, as
        # autocast's cast would (the cast of the masked gradient: the same bits as masking the cast one).
        return torch.where(inside, grad, 0.0).to(ctx.x_dtype), None, None


def fake_quantize(x: Tensor, fmt: FP4Format | str, ref: BlockFP4 | None = None, mode: str | None = None) -> Tensor:
    """Dequantized FP4 value of x (optionally guided by `ref`), with a straight-through gradient."""
    return straight_through(x, *fake_quantized(x.detach(), parse_format(fmt), ref, mode))


def straight_through(x: Tensor, value: Tensor, inside: Tensor) -> Tensor:
    """`value` in the forward; x's gradient where `inside`, blocked elsewhere (value, inside: fake_quantized's)."""
    return _StraightThrough.apply(x, value, inside)


class FakeQuantCache:
    """Fake-quantized weights shared by the micro-batches of one optimizer step.

    A weight is quantized at its first use and reused while it is the same tensor at the same version (an in-place
    update bumps the version); the trainer clears the cache after each step, so it never holds weights across a
    rollout. On medium-moe that quantizes 1.6B weights once a step instead of once a micro-batch. Under autocast
    (bf16 training compute) it keeps them in autocast's dtype, the cast each micro-batch's GEMMs would make: once a
    step instead of once a micro-batch, in half the memory (the GEMMs' inputs are the same bits).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[int, str], tuple[tuple[int, int, torch.dtype], Tensor, Tensor]] = {}

    def fake_quantize(self, w: Tensor, fmt: FP4Format, *, layer: int, name: str) -> Tensor:
        """Per-matrix fake quantization of weight w (guided to its own codes: plain RNE), straight-through."""
        device = w.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w.dtype
        stamp = (id(w), w._version, dtype)
        kept = self._kept.get((layer, name))
        if kept is None or kept[0] != stamp:
            plain = w.detach()
            value, inside = fake_quantized(plain, fmt, quantize_weight(plain, fmt), "full")
            kept = (stamp, value.to(dtype), inside)
            self._kept[(layer, name)] = kept
        return straight_through(w, kept[1], kept[2])

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
