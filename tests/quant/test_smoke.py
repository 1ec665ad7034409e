"""Fast end-to-end checks of the quant API against torchao (the exhaustive suite lives beside this)."""

import warnings

import pytest
import torch

from trace_lightning.quant import guided_quantize, quantize_mxfp4, quantize_nvfp4, row_global_scale

warnings.filterwarnings("ignore")


def test_nvfp4_row_scale_matches_torchao_bytes() -> None:
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 3
    g = row_global_scale(x)
    scales, packed = nvfp4_quantize(x, per_tensor_scale=g)
    ours = quantize_nvfp4(x, g)
    torch.testing.assert_close(ours.scale_bytes(), scales.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(ours.packed, packed, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_matches_torchao_bytes(mode: str) -> None:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    scales, packed = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(mode))
    ours = quantize_mxfp4(x, mode)
    torch.testing.assert_close(ours.scale_bytes(), scales.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(ours.packed, packed.view(torch.uint8), rtol=0, atol=0)


def test_parity_guidance_recovers_codes_under_small_perturbation() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    ref = quantize_nvfp4(x, row_global_scale(x))
    guided = guided_quantize(x * (1 + 1e-3), ref, "parity")
    torch.testing.assert_close(guided.dequantize(), ref.dequantize(), rtol=0, atol=0)
