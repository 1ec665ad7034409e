"""What NVFP4 and MXFP4 tensors share: packed E2M1 codes plus one scale per block.

A block-quantized tensor knows two things about its scales: how the quantizer mapped x into the
E2M1 range (`scale_input`, reproducing the quantizer's exact order of operations, so that guided
rounding on the training side sees the same scaled values), and the float32 multiplier that
dequantizes each block (`block_multiplier`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from trace_lightning.quant.e2m1 import check_float_input, decode_e2m1, encode_e2m1, pack_fp4, unpack_fp4


def divide(x: Tensor, divisor: float) -> Tensor:
    """x / divisor rounded once (IEEE division) on every device.

    On CUDA, PyTorch computes a tensor divided by a Python number (or a CPU scalar tensor) as a multiply by the
    float32 reciprocal, which rounds twice; on the CPU it divides. A divisor on x's own device is a true division
    on both, so a quantizer gives the same bytes on CPU and GPU, and the Triton kernels' ``div_rn`` matches it.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def split_blocks(x: Tensor, block_size: int) -> Tensor:
    """View x [..., K] as float32 blocks [..., K/block, block], checking K."""
    check_float_input(x)
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(f"last dim of shape {tuple(x.shape)} must be divisible by the block size {block_size}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


@dataclass
class BlockFP4(ABC):
    """Packed E2M1 codes [..., K/2] and per-block scales [..., K/block]."""

    packed: Tensor
    scales: Tensor
    block_size: ClassVar[int] = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def codes(self) -> Tensor:
        """Unpacked uint8 codes [..., K]."""
        return unpack_fp4(self.packed)

    def scale_bytes(self) -> Tensor:
        """The block scales as their uint8 bit patterns."""
        return self.scales.view(torch.uint8)

    @abstractmethod
    def block_multiplier(self) -> Tensor:
        """float32 [..., K/block]: the factor that turns a block's E2M1 values into real values."""

    @abstractmethod
    def scale_input(self, blocks: Tensor) -> Tensor:
        """Map float32 blocks [..., nb, block] into E2M1 units with this tensor's scales."""

    @abstractmethod
    def with_codes(self, codes: Tensor) -> BlockFP4:
        """A copy holding other codes under the same scales."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        values = decode_e2m1(self.codes(), checked=False)  # unpacked nibbles: 0..15 by construction
        values = values.reshape(*self.shape[:-1], -1, self.block_size)
        out = values * self.block_multiplier().unsqueeze(-1)
        return out.reshape(self.shape).to(dtype)


def encode_scaled(scaled: Tensor) -> Tensor:
    """Encode scaled blocks [..., nb, block]: packed codes [..., K/2].

    The quantizers' clamp to +-6 is left to the codec, which saturates (and keeps NaN at code 7) by itself.
    """
    return pack_fp4(encode_e2m1(scaled).flatten(-2))
