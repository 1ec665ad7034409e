"""trace_exact: one batch- and split-invariant forward for the rollout and the training step (arith, forward)."""

from trace_lightning.exact.forward import (
    ExactForward,
    exact_kernels_for,
    quantize_rows,
    rope_table,
)

__all__ = ["ExactForward", "exact_kernels_for", "quantize_rows", "rope_table"]
