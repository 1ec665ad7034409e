"""CPU emulation of every kernel op, written to match the kernels' arithmetic (the bit-exact reference).

Same signatures as trace_lightning.kernels; pick one through trace_lightning.ops.backend_for. Options after
`*` (e.g. compute_dtype) exist only here: they model how production kernels' numerics differ from the trainer.
"""

from trace_lightning.quant import quantize_weight  # the one weight quantizer (the kernels' twin launches it)
from trace_lightning.sim._weights import prefers_value_tiles, prefers_word_layout, prepare_weight, prepared_weight
from trace_lightning.sim.kv import fp4_kv_attention, kv_append
from trace_lightning.sim.linear import fp4_linear
from trace_lightning.sim.moe import fp4_moe
from trace_lightning.sim.norm import rms_norm
from trace_lightning.sim.quantize import (
    fake_quantize_nvfp4_rows,
    pack_parity,
    quantize_mxfp4,
    quantize_nvfp4,
    quantize_nvfp4_rows,
)
from trace_lightning.sim.record import write_record_slot
from trace_lightning.sim.rope import rope
from trace_lightning.sim.router import route_topk

__all__ = [
    "fake_quantize_nvfp4_rows",
    "fp4_kv_attention",
    "fp4_linear",
    "fp4_moe",
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
