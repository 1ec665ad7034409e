"""Bad arguments raise ValueError naming the offending value."""

from __future__ import annotations

import re

import pytest
import torch

from trace_lightning.quant import (
    FP4Format,
    fake_quantize,
    guided_quantize,
    parse_format,
    quantize,
    quantize_mxfp4,
    quantize_nvfp4,
    row_global_scale,
    tensor_global_scale,
)

QUANTIZERS = {
    "nvfp4": quantize_nvfp4,
    "nvfp4_row": lambda x: quantize_nvfp4(x, row_global_scale(x)),
    "mxfp4": quantize_mxfp4,
    "format": lambda x: FP4Format("nvfp4", "matrix").quantize(x),
    "fake": lambda x: fake_quantize(x, "mxfp4:rceil"),
    "row_global_scale": row_global_scale,
    "tensor_global_scale": tensor_global_scale,
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.uint8])
def test_unsupported_dtype(name: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=re.escape(str(dtype))):
        QUANTIZERS[name](torch.zeros(2, 64, dtype=dtype))


def test_non_tensor_input() -> None:
    with pytest.raises(ValueError, match="list"):
        quantize_nvfp4([[1.0] * 16])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fn", "shape", "block"),
    [
        (quantize_nvfp4, (4, 20), 16),
        (quantize_nvfp4, (2, 3, 8), 16),
        (quantize_mxfp4, (4, 48), 32),
        (quantize_mxfp4, (), 32),
    ],
)
def test_last_dim_not_divisible_by_block(fn: object, shape: tuple[int, ...], block: int) -> None:
    with pytest.raises(ValueError, match=rf"{re.escape(str(shape))}.*block size {block}"):
        fn(torch.zeros(shape))  # type: ignore[operator]


def test_float16_is_accepted_and_equals_its_float32_upcast() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).half()
    a, b = quantize_nvfp4(x, row_global_scale(x)), quantize_nvfp4(x.float(), row_global_scale(x.float()))
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_bytes(), b.scale_bytes())
    assert torch.equal(quantize_mxfp4(x).packed, quantize_mxfp4(x.float()).packed)


@pytest.mark.parametrize(
    ("make", "bad"),
    [
        (lambda: quantize_mxfp4(torch.zeros(1, 32), "ceil"), "'ceil'"),
        (lambda: FP4Format("mxfp4", mx_mode="even"), "'even'"),
        (lambda: FP4Format("fp8"), "'fp8'"),
        (lambda: FP4Format("nvfp4", global_scale="column"), "'column'"),
        (lambda: parse_format("int4"), "'int4'"),
        (lambda: parse_format("nvfp4:tensor"), "'tensor'"),
        (lambda: parse_format("mxfp4:even"), "'even'"),
        (lambda: parse_format(16), "int"),
        (lambda: fake_quantize(torch.zeros(1, 16), "nvfp8"), "'nvfp8'"),
    ],
)
def test_unknown_format_or_mode(make: object, bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(bad)):
        make()  # type: ignore[operator]


def test_unknown_guidance_mode_and_mode_without_record() -> None:
    x = torch.randn(2, 32)
    ref = quantize_nvfp4(x)
    with pytest.raises(ValueError, match="'soft'"):
        guided_quantize(x, ref, "soft")
    with pytest.raises(ValueError, match="'soft'"):
        fake_quantize(x, "nvfp4", ref=ref, mode="soft")
    with pytest.raises(ValueError, match="'full'"):
        quantize(x, "nvfp4", mode="full")


@pytest.mark.parametrize("shape", [(2, 64), (4, 16), (32,), (1, 2, 32)])
def test_guided_quantize_shape_mismatch(shape: tuple[int, ...]) -> None:
    ref = quantize_mxfp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match=re.escape(f"{shape}") + r".*\(2, 32\)"):
        guided_quantize(torch.zeros(shape), ref, "parity")
    with pytest.raises(ValueError, match=re.escape(f"{shape}")):
        fake_quantize(torch.zeros(shape), "mxfp4", ref=ref, mode="full")


@pytest.mark.parametrize("g_shape", [(4, 2), (3, 1), (2, 4, 1)])
def test_global_scale_that_does_not_fit_the_rows(g_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(str(g_shape))):
        quantize_nvfp4(torch.zeros(4, 64), torch.ones(g_shape))
