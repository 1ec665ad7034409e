"""Kernel tests run on CUDA when present, else on CPU through Triton's interpreter (tests/conftest.py turns it on
before anything imports Triton).

This makes two of the interpreter's roundings the hardware's: a dot whose rounding does not depend on the host's
BLAS, and float32 -> bfloat16 casts that round to nearest even.
"""

import numpy as np
import pytest
import torch


def _position_independent_interpreter_dot() -> None:
    """Under TRITON_INTERPRET, `tl.dot` is `np.matmul` in float32, and OpenBLAS's sgemm kernels (its Haswell one,
    picked on some AMD hosts) round a column differently depending on its position in the tile. A GPU MMA treats
    every row and column alike, so kernel tests (e.g. "the order of pairs within an expert changes nothing") must
    not see that artefact. This dot sums in float64 and rounds once to the accumulator's dtype. Under the
    interpreter the kernels pass bf16-valued operands as float32 (kernels._common.mma_torch_dtype), and for those
    every product and partial sum of a tile is exact in float64, so the result is the correctly rounded dot
    wherever its row and column sit, whatever BLAS the host has (float32-valued operands: within 2^-53 before the
    one rounding, so equal but for ties at a float32 midpoint)."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202 (Triton's API)
        if a.data.dtype.kind != "f" or b.data.dtype.kind != "f":  # fp8 stored as ints: Triton's own conversion
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(exact.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _round_to_nearest_even_bf16_casts() -> None:
    """Under TRITON_INTERPRET a float32 -> bfloat16 cast truncates (Triton 3.9's interpreter drops the low bits);
    on a GPU, and in torch, it rounds to nearest even. Cast the way the hardware does, so bf16 results under the
    interpreter are the GPU's and can be compared bit for bit (torch's cast: RNE, NaN kept)."""
    from triton import language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202 (Triton's API)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


if not torch.cuda.is_available():
    _position_independent_interpreter_dot()
    _round_to_nearest_even_bf16_casts()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
