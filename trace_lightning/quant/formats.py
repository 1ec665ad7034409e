"""FP4 format descriptors: which block format, how the NVFP4 global scale is taken, which MX rule.

Weights take one global scale per matrix (per expert for stacked experts) and activations one per
row, so a token's quantization never depends on what else is in the batch (DESIGN.md section 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from trace_lightning.quant.blocks import BlockFP4
from trace_lightning.quant.mxfp4 import MXFP4_BLOCK, check_mx_mode, quantize_mxfp4
from trace_lightning.quant.nvfp4 import NVFP4, NVFP4_BLOCK, quantize_nvfp4, row_global_scale, tensor_global_scale

FORMAT_KINDS = ("nvfp4", "mxfp4")
GLOBAL_SCALES = ("row", "matrix", "none")


NVFP4Quantizer = Callable[[Tensor, Tensor | None], NVFP4]
"""(x, global scale or None) -> NVFP4: the reference's quantize_nvfp4, or a backend's byte-equal twin."""


@dataclass(frozen=True)
class FP4Format:
    """An FP4 block format and its scaling granularity."""

    kind: str = "nvfp4"
    """Block format: "nvfp4" (16-element blocks, E4M3 scales) or "mxfp4" (32, E8M0)."""
    global_scale: str = "row"
    """NVFP4 global scale: "row" (activations, K/V), "matrix" (weights), or "none"."""
    mx_mode: str = "floor"
    """MXFP4 scale rule: "floor" or "rceil"."""

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_KINDS:
            raise ValueError(f"unknown FP4 format {self.kind!r}; expected one of {FORMAT_KINDS}")
        if self.global_scale not in GLOBAL_SCALES:
            raise ValueError(f"unknown global scale {self.global_scale!r}; expected one of {GLOBAL_SCALES}")
        check_mx_mode(self.mx_mode)

    @property
    def block_size(self) -> int:
        return NVFP4_BLOCK if self.kind == "nvfp4" else MXFP4_BLOCK

    def for_weights(self) -> FP4Format:
        return FP4Format(self.kind, "matrix", self.mx_mode)

    def quantize(self, x: Tensor, nvfp4: NVFP4Quantizer = quantize_nvfp4) -> BlockFP4:
        """x in this format; `nvfp4` quantizes given the global scale chosen here (the Triton backend passes its
        kernel, byte-equal to the reference)."""
        if self.kind == "mxfp4":
            return quantize_mxfp4(x, self.mx_mode)
        if self.global_scale == "none":
            return nvfp4(x, None)
        if self.global_scale == "row":
            return nvfp4(x, row_global_scale(x))
        # One scale per matrix, [..., 1, 1] for stacked experts [E, out, in] too.
        g = tensor_global_scale(x, dims=min(2, x.dim()))
        return nvfp4(x, g.unsqueeze(-1) if x.dim() >= 3 else g)


def quantize_weight(w: Tensor, fmt: FP4Format | str, nvfp4: NVFP4Quantizer = quantize_nvfp4) -> BlockFP4:
    """FP4 of a weight [N, K] or stacked experts [E, N, K] exactly as given: one NVFP4 global scale per matrix (per
    expert). The one weight quantizer: the trainer's QAT hook and the rollout's converter both call it (the Triton
    engine with its own `nvfp4` kernel, byte-equal by test), so the weight codes agree on any device, and the sync
    audit compares its bytes on both sides."""
    return parse_format(fmt).for_weights().quantize(w, nvfp4)


def parse_format(fmt: FP4Format | str) -> FP4Format:
    """Accept an FP4Format or a short name: "nvfp4", "nvfp4:matrix", "nvfp4:none", "mxfp4", "mxfp4:rceil"."""
    if isinstance(fmt, FP4Format):
        return fmt
    if not isinstance(fmt, str):
        raise ValueError(f"FP4 format must be an FP4Format or a string, got {type(fmt).__name__}")
    kind, _, option = fmt.partition(":")
    if kind == "mxfp4":
        return FP4Format("mxfp4", mx_mode=option or "floor")
    return FP4Format(kind, global_scale=option or "row")
