"""The E2M1 (FP4) element codec and nibble packing.

A code c in 0..15 has the sign in bit 3 and a magnitude index c & 7 into
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Encoding rounds to nearest, ties to even, saturating at 6, exactly as
`torch.float4_e2m1fn_x2` and `ml_dtypes.float4_e2m1fn` casts do. Bit 0 of a code is the mantissa
bit of the magnitude, which is what a parity record keeps.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Decision thresholds between neighbouring magnitudes. A tie rounds to the even (mantissa 0) neighbour:
# down at 0.25, 1.25, 2.5 and 5, up at 0.75, 1.75 and 3.5.
_TIES_ROUND_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
_CODE_TO_VALUE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_input(x: Tensor, what: str = "input") -> None:
    """Raise ValueError unless x is a floating tensor the quantizers accept."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what} has unsupported dtype {x.dtype}; expected one of {_FLOAT_DTYPES}")


def encode_e2m1(x: Tensor) -> Tensor:
    """Round x to the nearest E2M1 value (ties to even, saturating) and return uint8 codes 0..15.

    NaN encodes as +6 (code 7): E2M1 has no NaN, so the block quantizers mark such blocks through
    their scale instead; the fixed code keeps kernel and emulator bytes identical.
    """
    check_float_input(x)
    x = x.float()
    mag = x.abs()
    # The magnitude index counts the thresholds mag passes: 7 minus those it does not. Every comparison
    # is false for inf and NaN, so both saturate at index 7 without a clamp. One reused bool buffer
    # keeps large inputs from paying for a fresh allocation per threshold.
    not_passed = (mag <= _TIES_ROUND_DOWN[0]).to(torch.uint8)
    buffer = torch.empty_like(mag, dtype=torch.bool)
    for threshold in _TIES_ROUND_DOWN[1:]:
        not_passed += torch.le(mag, threshold, out=buffer)
    for threshold in _TIES_ROUND_UP:
        not_passed += torch.lt(mag, threshold, out=buffer)
    negative = torch.signbit(x).logical_and_(torch.eq(x, x, out=buffer))  # NaN keeps the positive code
    return not_passed.neg_().add_(7) | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: Tensor, *, checked: bool = True) -> Tensor:
    """Map uint8 codes 0..15 to their float32 values (code 8 is -0.0). `checked=False` skips the range check, a host
    read of the maximum (a device sync on a GPU), for codes that cannot exceed 15: nibbles unpacked from bytes."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if checked and codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must lie in 0..15, got a maximum of {int(codes.max())}")
    return _code_values(codes.device)[codes.long()]


@functools.cache
def _code_values(device: torch.device) -> Tensor:
    """The code -> value table on `device`, copied there once (not a host-to-device copy per call)."""
    return _CODE_TO_VALUE.to(device)


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack pairs of codes along the last dim into bytes, the even index in the low nibble."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4 pairs, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of pack_fp4: bytes [..., K/2] -> codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
