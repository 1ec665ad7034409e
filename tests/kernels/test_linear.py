"""Triton fp4_linear against the sim within float32-accumulation tolerance (bf16 outputs: bf16 rounding)."""

import pytest
import torch
import triton
import triton.language as tl

from trace_lightning import kernels, sim
from trace_lightning.kernels._fp4 import _permute_pairs, permute_k
from trace_lightning.kernels.linear import linear
from trace_lightning.quant import quantize_nvfp4
from trace_lightning.sim.testing import quantize_weight


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(3, 40, 96), (20, 70, 256), (1, 64, 512)])
def test_fp4_linear_matches_sim(device: str, dtype: torch.dtype, mnk: tuple[int, int, int]) -> None:
    M, N, K = mnk
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = quantize_weight(torch.randn(N, K, generator=gen).to(device))
    ref = sim.fp4_linear(x, w, out_dtype=torch.float32)
    out = kernels.fp4_linear(x, w)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 5e-3)
    assert rel_err(kernels.fp4_linear(x, w, out_dtype=torch.float32), ref) < 1e-5
    assert rel_err(linear(x, w, torch.float32, split_k=2), ref) < 1e-5  # split-K partials + deterministic sum


def test_fp4_linear_global_shapes(device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(32, 64, generator=gen).to(device)
    x = torch.randn(5, 64, generator=gen).to(device)
    for g in (None, torch.tensor(0.02), torch.rand(32, 1, generator=gen) * 0.02):
        q = quantize_nvfp4(w, None if g is None else g.to(device))
        assert rel_err(kernels.fp4_linear(x, q), sim.fp4_linear(x, q)) < 1e-6


@pytest.mark.parametrize("rows", [20, 96])
def test_fp4_linear_both_operand_orders(device: str, rows: int) -> None:
    """Up to SWAP_MAX_ROWS rows out^T = w @ x^T (decode), above x @ w^T (prefill)."""
    from trace_lightning.kernels.linear import SWAP_MAX_ROWS

    assert (rows <= SWAP_MAX_ROWS) == (rows == 20)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 256, generator=gen).to(device)
    w = quantize_weight(torch.randn(70, 256, generator=gen).to(device))
    ref = sim.fp4_linear(x, w, out_dtype=torch.float32)
    assert rel_err(kernels.fp4_linear(x, w), ref) < 1e-6
    assert rel_err(linear(x, w, torch.float32, split_k=2), ref) < 1e-5


@pytest.mark.parametrize("layout", ["stored", "words", "tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp4_linear_reads_every_byte_and_scale_exactly(device: str, dtype: torch.dtype, layout: str) -> None:
    """Identity activations pull each dequantized weight out of the GEMM unchanged (one product per output, fp32
    accumulation), so the kernel's dequantization must equal code * scale * global bit for bit: all 256 packed
    bytes, every finite non-negative E4M3 scale byte (subnormals and zero included), bf16 operands (the packed
    bf16x2 PTX path on CUDA) and fp16 ones (the portable path, which the interpreter takes for both), with the
    weight in stored order, in the kernels' word layout (its own PTX decoder on CUDA) or also in their tiles (read
    in tiles by every path; M = 64 takes half a tile per K step)."""
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("the interpreter reads bf16 through the portable path already")
    from trace_lightning.quant import NVFP4, decode_e2m1, unpack_fp4
    from trace_lightning.quant.words import WordNVFP4

    N, K = 128, 256
    gen = torch.Generator().manual_seed(5)
    packed = torch.arange(N * K // 2).remainder(256).reshape(N, K // 2)
    packed = packed[:, torch.randperm(K // 2, generator=gen)].to(torch.uint8)
    scale_bytes = torch.arange(N * K // 16).remainder(127).reshape(N, K // 16).to(torch.uint8)  # 0x00..0x7E
    g = torch.rand(N, 1, generator=gen) * 3 + 0.01
    w = NVFP4(packed.to(device), scale_bytes.view(torch.float8_e4m3fn).to(device), g.to(device))
    if layout != "stored":
        w = WordNVFP4.from_stored(w, tiled=layout == "tiles")
    codes = decode_e2m1(unpack_fp4(packed)).unflatten(-1, (-1, 16))
    expected = ((codes * scale_bytes.view(torch.float8_e4m3fn).float().unsqueeze(-1)).flatten(-2) * g).T  # [K, N]
    eye = torch.eye(K, dtype=dtype, device=device)
    for m0 in range(0, K, 64):  # M <= 64: the swapped (decode) operand order
        out = kernels.fp4_linear(eye[m0:m0 + 64], w, out_dtype=torch.float32)
        torch.testing.assert_close(out.cpu(), expected[m0:m0 + 64], rtol=0, atol=0)
    out = kernels.fp4_linear(eye[:16], w, out_dtype=torch.float32)  # M = 16: 128-wide K steps (whole tiles)
    torch.testing.assert_close(out.cpu(), expected[:16], rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 1])
def test_sum_partials_matches_torch(device: str, dim: int) -> None:
    from trace_lightning.kernels.reduce import sum_partials

    y = torch.randn(5, 7, 1500, generator=torch.Generator().manual_seed(dim)).to(device)
    ref = sum(y.unbind(dim))  # left to right, as the kernel adds
    torch.testing.assert_close(sum_partials(y, dim, torch.float32), ref, rtol=0, atol=0)
    out = sum_partials(y, dim, torch.bfloat16)  # the interpreter's bf16 cast is not round-to-nearest: 1 ulp
    assert out.dtype == torch.bfloat16 and out.shape == ((7, 1500) if dim == 0 else (5, 1500))
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=2**-7, atol=0)


@triton.jit
def _orders(lo_ptr, hi_ptr, by_pairs_ptr, by_cols_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    lo = tl.load(lo_ptr + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :])
    hi = tl.load(hi_ptr + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :])
    out = r[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(by_pairs_ptr + out, tl.reshape(tl.join(_permute_pairs(lo, R, C), _permute_pairs(hi, R, C)), (R, C)))
    tl.store(by_cols_ptr + out, permute_k(tl.reshape(tl.join(lo, hi), (R, C)), R, C))


def test_permute_k_orders_agree(device: str) -> None:
    """The GEMMs contract K in permute_k order; the fast weight path gets there by permuting per-byte results
    (_permute_pairs), the activation side by permuting columns. Both must give the same order, and that order
    must be the documented one: column pair 4j + t holds stored pair (C / 8) t + j."""
    for C in (16, 64, 128):
        R = 4
        natural = torch.arange(R * C, dtype=torch.int32, device=device).reshape(R, C)
        by_pairs, by_cols = torch.empty_like(natural), torch.empty_like(natural)
        _orders[(1,)](natural[:, 0::2].contiguous(), natural[:, 1::2].contiguous(), by_pairs, by_cols, R, C)
        beta = torch.arange(C // 2)
        stored_pair = (C // 8) * (beta % 4) + beta // 4
        expected = natural.cpu()[:, torch.stack((2 * stored_pair, 2 * stored_pair + 1), dim=1).flatten()]
        torch.testing.assert_close(by_cols.cpu(), expected, rtol=0, atol=0)
        torch.testing.assert_close(by_pairs.cpu(), expected, rtol=0, atol=0)
