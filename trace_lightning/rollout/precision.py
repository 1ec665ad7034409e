"""The rollout's numerics: a plain compute dtype, or FP4 weights / activations / KV cache on top of one.

Running the engine in bf16 while training runs fp32 models a production deployment whose kernels
round differently from the trainer; the FP4 parts are the quantization the trainer must align with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_lightning.quant import FP4Format

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16 or their short names "fp32" / "bf16"."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown compute dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute dtype must be float32 or bfloat16, got {dtype}")
    return dtype


@dataclass(frozen=True)
class FP4Precision:
    """FP4 rollout: which tensors are FP4 and the dtype everything else computes in."""

    fmt: str = "nvfp4"
    """Block format: "nvfp4" or "mxfp4"."""
    mx_mode: str = "floor"
    """MXFP4 scale rule: "floor" or "rceil"."""
    weights: bool = True
    """Projection and expert weights in FP4 (per-matrix global scale, per expert for stacked experts)."""
    activations: bool = True
    """Inputs of every projection (sites attn_in, attn_out, moe_in, moe_down, shared_down) in FP4, per row."""
    kv: bool = True
    """K/V cache in FP4 (sites k, v: one NVFP4/MXFP4 row per token-head); False keeps it in compute dtype."""
    compute_dtype: torch.dtype | str = torch.bfloat16
    """Dtype of everything that is not FP4 (embeddings, norms, router, lm_head, GEMM outputs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_dtype", parse_dtype(self.compute_dtype))
        FP4Format(self.fmt, "row", self.mx_mode)  # validates fmt and mx_mode

    @property
    def activation_format(self) -> FP4Format:
        """Per-row format of activations and K/V."""
        return FP4Format(self.fmt, "row", self.mx_mode)

    @property
    def weight_format(self) -> FP4Format:
        """Per-matrix format of weights."""
        return self.activation_format.for_weights()


def resolve_precision(precision: FP4Precision | str) -> tuple[torch.dtype, FP4Precision | None]:
    """"fp32" / "bf16" (no FP4) or an FP4Precision -> (compute dtype, the FP4 part or None)."""
    if isinstance(precision, FP4Precision):
        return precision.compute_dtype, precision
    if isinstance(precision, str) and precision in ("fp32", "bf16"):
        return parse_dtype(precision), None
    raise ValueError(f"precision must be 'fp32', 'bf16' or an FP4Precision, got {precision!r}")
