"""The fused training fake-quant kernels give the reference's values and clamp masks bit for bit (plain RNE, and guided
by full or parity records of NVFP4 with row, matrix or no global scale), with ties, zero rows, wide rows and NaN /
inf blocks; the plain values are also checked against ml_dtypes' E2M1 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import Tensor

from trace_lightning.kernels.fake_quant import fused_fake_quantized, guided_fake_quantized, plain_fake_quantized
from trace_lightning.quant import parse_format, quantize
from trace_lightning.quant.blocks import split_blocks
from trace_lightning.quant.fake import reference_fake_quantized as fake_quantized

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter

DTYPES = [torch.float32, torch.bfloat16]


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bit-identical floats, any NaN equal to any NaN (CUDA's NaN bits need not be torch's)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    as_int = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(as_int), b[~nan].view(as_int))


def activations(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """Heavy-tailed rows over many binades, an all-zero row, and E2M1 ties: 16-blocks of +-6 * 2^k then midpoints."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape[:-1], generator=gen)).unsqueeze(-1)
    x = x * torch.exp(torch.randn(shape, generator=gen))
    rows = x.reshape(-1, shape[-1])
    rows[0] = 0.0
    signs = torch.tensor([1.0, -1.0]).repeat_interleave(8)
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * signs
    if rows.shape[0] > 1:
        rows[1] = (ties * 2.0 ** -3).repeat(shape[-1] // 16)
    return x.to(dtype)


def with_nonfinite(x: Tensor) -> Tensor:
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    rows[-1, 3] = float("nan")
    rows[-1, 20 % x.shape[-1]] = float("inf")
    if rows.shape[0] > 2:
        rows[2, -1] = float("-inf")
    return x


def assert_matches_reference(x: Tensor, fmt: str, ref=None, mode: str | None = None) -> tuple[Tensor, Tensor]:
    fused = fused_fake_quantized(x, parse_format(fmt), ref, mode)
    assert fused is not None
    value, inside = fused
    want_value, want_inside = fake_quantized(x, parse_format(fmt), ref, mode)
    assert value.dtype == x.dtype and inside.dtype == torch.bool
    assert same_bits(value, want_value)
    assert torch.equal(inside.cpu(), want_inside.cpu())
    return value, inside


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 48), (3, 2064)])
def test_plain_equals_the_reference(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    x = activations(shape, 0, dtype).to(device)
    value, inside = assert_matches_reference(x, "nvfp4")
    assert inside.any() and (value != 0).any()
    assert_matches_reference(with_nonfinite(x), "nvfp4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_values_are_ml_dtypes_e2m1_rounding_of_the_scaled_input(dtype: torch.dtype, device: str) -> None:
    """An oracle outside our code for the codes: ml_dtypes rounds x * ((1 / global) / scale) to E2M1 (RNE,
    saturating at 6) exactly as the kernel's values divided by scale * global say it did."""
    x = activations((6, 128), 1, dtype).to(device)
    value, inside = plain_fake_quantized(x)
    q = quantize(x.float().cpu(), "nvfp4")
    scaled = q.scale_input(split_blocks(x.float().cpu(), 16)).reshape(x.shape)
    e2m1 = torch.from_numpy(np.clip(scaled.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    multiplier = q.block_multiplier().repeat_interleave(16, -1)
    assert same_bits(value.cpu(), (e2m1 * multiplier).to(dtype))
    assert torch.equal(inside.cpu(), scaled.abs() <= 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["full", "parity"])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4:none"])
def test_guided_equals_the_reference(fmt: str, mode: str, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x_rollout = activations((4, 3, 80), 2, torch.float32)
    ref = quantize(x_rollout, fmt)
    x = (x_rollout * (1 + 0.25 * torch.randn(x_rollout.shape, generator=gen))).to(dtype)
    ref = type(ref)(**{k: None if v is None else v.to(device) for k, v in vars(ref).items()})
    value, _ = assert_matches_reference(x.to(device), fmt, ref, mode)
    if mode == "parity":  # guidance departs from the record's codes somewhere, and the kernel followed it
        assert not same_bits(value, ref.dequantize(dtype))
    assert_matches_reference(with_nonfinite(x).to(device), fmt, ref, mode)


def test_guided_by_a_weights_own_codes_per_expert_global(device: str) -> None:
    """The QAT weight path: stacked experts [E, N, K] guided (full) by their own matrix-global quantization."""
    w = activations((3, 8, 2064), 3, torch.float32).to(device)
    value, inside = assert_matches_reference(w, "nvfp4:matrix", quantize(w, parse_format("nvfp4").for_weights()),
                                             "full")
    assert inside.float().mean() > 0.9


def test_refuses_a_record_of_another_shape_or_format(device: str) -> None:
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="does not match the record's shape"):
        guided_fake_quantized(x, quantize(torch.randn(2, 48), "nvfp4"), "parity")
    with pytest.raises(ValueError, match="NVFP4 record"):
        guided_fake_quantized(x, quantize(torch.randn(2, 32), "mxfp4"), "parity")
    with pytest.raises(ValueError, match="guidance mode"):
        guided_fake_quantized(x, quantize(x, "nvfp4"), "nearest")
    assert fused_fake_quantized(x, parse_format("mxfp4")) is None  # the reference's to run
