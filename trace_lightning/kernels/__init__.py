"""Triton FP4 kernels; every op has a CPU twin in trace_lightning.sim with the same signature.

These functions always launch their kernel (on CPU tensors only under TRITON_INTERPRET=1); choosing
Triton or the sim is trace_lightning.ops.backend_for's job alone. How they launch (autotuning, launch shapes,
programmatic dependent launch) is a KernelOptions, set for a block of calls with `kernel_options(...)`.
"""

from trace_lightning.kernels._common import AttentionLaunch, GemmLaunch, KernelOptions, QuantizeLaunch, kernel_options
from trace_lightning.kernels.kv import fp4_kv_attention, kv_append
from trace_lightning.kernels.layout import prefers_value_tiles, prefers_word_layout, prepare_weight, prepared_weight
from trace_lightning.kernels.linear import fp4_linear
from trace_lightning.kernels.moe import fp4_moe
from trace_lightning.kernels.norm import rms_norm
from trace_lightning.kernels.quantize import (
    fake_quantize_nvfp4_rows,
    pack_parity,
    quantize_mxfp4,
    quantize_nvfp4,
    quantize_nvfp4_rows,
    quantize_weight,
)
from trace_lightning.kernels.record import write_record_slot
from trace_lightning.kernels.rope import rope
from trace_lightning.kernels.router import route_topk

__all__ = [
    "AttentionLaunch",
    "GemmLaunch",
    "KernelOptions",
    "QuantizeLaunch",
    "fake_quantize_nvfp4_rows",
    "fp4_kv_attention",
    "fp4_linear",
    "fp4_moe",
    "kernel_options",
    "kv_append",
    "pack_parity",
    "prefers_value_tiles",
    "prefers_word_layout",
    "prepare_weight",
    "prepared_weight",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_nvfp4_rows",
    "quantize_weight",
    "rms_norm",
    "rope",
    "route_topk",
    "write_record_slot",
]
