"""The E2M1 codec and nibble packing against ml_dtypes, torch's float4_e2m1fn_x2 reference and compressed-tensors."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import Tensor

from trace_lightning.quant import E2M1_VALUES, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4

ALL_CODES = torch.arange(16, dtype=torch.uint8)
# Every (even, odd) code pair, ordered so that pair i packs into the byte i.
ALL_PAIRS = torch.stack((torch.arange(256) & 0xF, torch.arange(256) >> 4), dim=-1).to(torch.uint8)


def bits(x: Tensor) -> Tensor:
    """float32 bit patterns, so that -0.0 and 0.0 differ."""
    return x.float().contiguous().view(torch.int32)


def ml_dtypes_codes(x: np.ndarray) -> Tensor:
    return torch.from_numpy(x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy())


def sweep_values() -> Tensor:
    """> 10^6 float32 values: random bit patterns (no NaN), a dense range, and 2048 ulps around every tie."""
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=gen).view(torch.float32)
    patterns = patterns[~torch.isnan(patterns)]
    dense = torch.linspace(-7.0, 7.0, 1 << 19)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0])
    offsets = torch.arange(-2048, 2049, dtype=torch.int32)
    near = (ties.view(torch.int32)[:, None] + offsets[None, :]).view(torch.float32).flatten()
    near = near[~torch.isnan(near)]
    specials = torch.tensor([0.0, float("inf"), 1e30, 6.5, 2.0**-149, 3.4028235e38, 2.0**-126])
    values = torch.cat((patterns, dense, near, specials))
    return torch.cat((values, -values))


def test_decode_every_code_equals_ml_dtypes_and_torch(torch_fp4: types.SimpleNamespace) -> None:
    ours = decode_e2m1(ALL_CODES)
    expected = torch.from_numpy(ALL_CODES.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(bits(ours), bits(expected))
    assert torch.equal(bits(ours), bits(torch_fp4._floatx_unpacked_to_f32(ALL_CODES, 2, 1)))
    assert ours.tolist() == [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    assert bits(ours)[8].item() == bits(torch.tensor(-0.0)).item()


def test_every_code_round_trips() -> None:
    assert torch.equal(encode_e2m1(decode_e2m1(ALL_CODES)), ALL_CODES)
    assert torch.equal(encode_e2m1(decode_e2m1(ALL_CODES).bfloat16()), ALL_CODES)
    assert torch.equal(encode_e2m1(decode_e2m1(ALL_CODES).half()), ALL_CODES)


# Midpoints between neighbours round to the value whose mantissa bit is 0 (even code).
TIES = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ties_round_to_even_code(dtype: torch.dtype) -> None:
    x = torch.tensor(list(TIES), dtype=dtype)
    expected = torch.tensor(list(TIES.values()), dtype=torch.uint8)
    assert torch.equal(encode_e2m1(x), expected)
    assert torch.equal(encode_e2m1(-x), expected | 8)


def test_saturation_and_signed_zero() -> None:
    big = torch.tensor([6.0, 6.5, 7.0, 1e30, 3.4028235e38, float("inf")])
    assert encode_e2m1(big).tolist() == [7] * 6
    assert encode_e2m1(-big).tolist() == [15] * 6
    assert encode_e2m1(torch.tensor([-0.0, -1e-45, -0.25, 0.0, 1e-45, 0.25])).tolist() == [8, 8, 8, 0, 0, 0]


def test_nan_encodes_as_documented_fixed_code() -> None:
    assert encode_e2m1(torch.tensor([float("nan"), -float("nan")])).tolist() == [7, 7]


def test_million_value_sweep_equals_ml_dtypes_and_torch(torch_fp4: types.SimpleNamespace) -> None:
    x = sweep_values()
    assert x.numel() > 1_000_000
    ours = encode_e2m1(x)
    assert torch.equal(ours, ml_dtypes_codes(x.numpy()))
    assert torch.equal(ours, torch_fp4._f32_to_floatx_unpacked(x, 2, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern_equals_ml_dtypes(dtype: torch.dtype) -> None:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[~torch.isnan(x)]
    np_dtype = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16
    expected = ml_dtypes_codes(x.view(torch.int16).numpy().view(np_dtype))
    assert torch.equal(encode_e2m1(x), expected)


def test_packing_is_torch_float4_e2m1fn_x2_layout(torch_fp4: types.SimpleNamespace) -> None:
    packed = pack_fp4(ALL_PAIRS.flatten())
    assert torch.equal(packed, torch.arange(256, dtype=torch.uint8))  # even index in the low nibble
    assert torch.equal(packed, torch_fp4.pack_uint4(ALL_PAIRS.flatten()))
    as_bf16 = decode_e2m1(ALL_PAIRS.flatten()).bfloat16()
    x2 = torch_fp4._bfloat16_to_float4_e2m1fn_x2(as_bf16)
    assert x2.dtype == torch.float4_e2m1fn_x2 and x2.shape == (256,)
    assert torch.equal(x2.view(torch.uint8), packed)
    ours_x2 = pack_fp4(encode_e2m1(as_bf16)).view(torch.float4_e2m1fn_x2)
    assert ours_x2.element_size() == 1 and torch.equal(ours_x2.view(torch.uint8), x2.view(torch.uint8))


def test_unpack_inverts_pack_on_3d_codes() -> None:
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(packed[..., 0], codes[..., 0] | (codes[..., 1] << 4))
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(torch.arange(256, dtype=torch.uint8)), ALL_PAIRS.flatten())


def test_compressed_tensors_fp4_helpers_agree() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    values = decode_e2m1(ALL_PAIRS.reshape(16, 32))
    assert torch.equal(pack_fp4_to_uint8(values), pack_fp4(ALL_PAIRS.reshape(16, 32)))
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    theirs = unpack_fp4_from_uint8(all_bytes, 16, 32, dtype=torch.float32)
    assert torch.equal(bits(theirs), bits(decode_e2m1(unpack_fp4(all_bytes))))
    # Their cast drops the sign of zero (torch.sign(-0.0) == 0), so compare values, where -0.0 == 0.0.
    x = torch.linspace(-8.0, 8.0, 1 << 16)
    x = torch.cat((x, torch.tensor([*TIES, *(-t for t in TIES), float("inf"), -float("inf")])))
    assert torch.equal(cast_to_fp4(x.clone()), decode_e2m1(encode_e2m1(x)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8])
def test_encode_rejects_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=str(dtype)):
        encode_e2m1(torch.zeros(4, dtype=dtype))


def test_codec_errors_name_the_offending_value() -> None:
    with pytest.raises(ValueError, match="maximum of 16"):
        decode_e2m1(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.int64"):
        decode_e2m1(torch.tensor([3]))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.float32"):
        unpack_fp4(torch.zeros(2))
    with pytest.raises(ValueError, match="list"):
        encode_e2m1([1.0])  # type: ignore[arg-type]


def test_decode_checks_the_code_range_unless_the_codes_are_unpacked_nibbles() -> None:
    with pytest.raises(ValueError, match="codes must lie in 0..15, got a maximum of 16"):
        decode_e2m1(torch.tensor([3, 16], dtype=torch.uint8))
    packed = pack_fp4(ALL_CODES)
    assert torch.equal(decode_e2m1(unpack_fp4(packed), checked=False), decode_e2m1(ALL_CODES))
