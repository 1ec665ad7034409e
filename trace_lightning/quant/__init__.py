"""FP4 formats: the E2M1 codec, NVFP4 / MXFP4 block quantizers, packing, guided rounding, STE fake-quant.

Pure torch and device-agnostic; bit-exact with torchao 0.18 and torch's float4 dtype.
"""

from trace_lightning.quant.blocks import BlockFP4
from trace_lightning.quant.e2m1 import E2M1_MAX, E2M1_VALUES, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4
from trace_lightning.quant.fake import FakeQuantCache, fake_quantize, quantize
from trace_lightning.quant.formats import FP4Format, parse_format, quantize_weight
from trace_lightning.quant.guided import GUIDANCE_MODES, guided_quantize, parity_round
from trace_lightning.quant.mxfp4 import MX_MODES, MXFP4, MXFP4_BLOCK, quantize_mxfp4
from trace_lightning.quant.nvfp4 import NVFP4, NVFP4_BLOCK, quantize_nvfp4, row_global_scale, tensor_global_scale

__all__ = [
    "BlockFP4",
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4Format",
    "GUIDANCE_MODES",
    "MXFP4",
    "MXFP4_BLOCK",
    "MX_MODES",
    "NVFP4",
    "NVFP4_BLOCK",
    "decode_e2m1",
    "encode_e2m1",
    "FakeQuantCache",
    "fake_quantize",
    "guided_quantize",
    "pack_fp4",
    "parity_round",
    "parse_format",
    "quantize",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_weight",
    "row_global_scale",
    "tensor_global_scale",
    "unpack_fp4",
]
