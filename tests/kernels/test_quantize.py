"""Triton quantizers give the sim's bytes exactly: random data, every scale byte, ties, specials, RCEIL edges."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_lightning import kernels, sim
from trace_lightning.kernels._fp4 import encode_e2m1
from trace_lightning.kernels.quantize import quantize_nvfp4_rows_operand
from trace_lightning.quant import NVFP4, BlockFP4

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
TIES = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 tensors, any NaN equal to any NaN (CUDA's NaN bits need not be torch's)."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def assert_same(a: BlockFP4, b: BlockFP4) -> None:
    assert a.packed.shape == b.packed.shape and a.scales.dtype == b.scales.dtype
    assert torch.equal(a.packed.cpu(), b.packed.cpu()), "codes differ"
    assert torch.equal(a.scale_bytes().cpu(), b.scale_bytes().cpu()), "scale bytes differ"
    ga, gb = getattr(a, "global_scale", None), getattr(b, "global_scale", None)
    if ga is not None or gb is not None:
        assert same_bits(ga, gb), "global scales differ"


def special_rows(block: int) -> torch.Tensor:
    """Rows of exact ties (scaled by 6 so amax lands on the grid), signed zeros, subnormals, inf and NaN."""
    ties = torch.tensor(TIES)
    rows = [torch.cat([ties, -ties]).repeat(block // 16 if block >= 16 else 1)[: 2 * block]]
    rows.append(torch.tensor([-0.0, 0.0] * block))
    rows.append(torch.full((2 * block,), 1e-40) * torch.arange(2 * block))
    row = torch.randn(2 * block, generator=torch.Generator().manual_seed(5))
    for special in (float("inf"), float("-inf"), float("nan")):
        r = row.clone()
        r[3] = special
        rows.append(r)
    rows.append(torch.zeros(2 * block))
    return torch.stack(rows)


def every_scale_byte_blocks() -> torch.Tensor:
    """(127, 16) blocks, block i's amax / 6 the i-th non-negative finite E4M3 value, each holding every tie."""
    finite = E4M3_VALUES[torch.isfinite(E4M3_VALUES) & (E4M3_VALUES >= 0)]  # 127 values incl. subnormals
    blocks = (torch.tensor(TIES) / 6.0)[None, :] * 6.0 * finite[:, None]  # amax = 6 * value
    blocks[:, 1::2] *= -1
    return blocks


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, encode_e2m1(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_encode_e2m1_equals_ml_dtypes_near_every_threshold(device: str) -> None:
    """The device encoder (float32 rounding, no compares) gives ml_dtypes' saturating RNE E2M1 code for every
    float32 within 4 ulps of each rounding threshold and grid point, both signs, and over 2^-140 .. 2^100."""
    points = np.array(TIES + [6.0, 7.0, 8.0, 1e30, 3.4e38], dtype=np.float32)
    ulps = np.arange(-4, 5, dtype=np.int32)
    near = (points.view(np.int32)[:, None] + ulps[None, :]).reshape(-1).view(np.float32)
    near = near[np.isfinite(near)]  # 0 minus an ulp is a NaN pattern; the sign flip below covers it
    wide = np.exp2(np.random.default_rng(0).uniform(-140, 100, 4096)).astype(np.float32)
    x = np.concatenate([near, wide, [0.0, 1e-45, np.inf], np.arange(0, 8, 1 / 64, dtype=np.float32)])
    x = np.concatenate([x, -x]).astype(np.float32)
    expected = torch.from_numpy(x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).astype(np.int32))
    out = torch.empty(x.size, dtype=torch.int32, device=device)
    _encode_kernel[(triton.cdiv(x.size, 1024),)](torch.from_numpy(x).to(device), out, x.size, 1024)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    nan = torch.full((16,), float("nan"), device=device)
    _encode_kernel[(1,)](nan, out, 16, 16)
    assert out[:16].eq(7).all()  # NaN -> 7 (the sim's rule; E2M1 has no NaN)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 640), (1, 16), (2, 8192), (3, 8448)])  # 1 pass / chunks
def test_nvfp4_random_bytes(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape[:-1] + (1,), generator=gen)))
    x = x.to(dtype).to(device)
    assert_same(kernels.quantize_nvfp4_rows(x), sim.quantize_nvfp4_rows(x))
    assert_same(kernels.quantize_nvfp4(x), sim.quantize_nvfp4(x))
    assert_same(kernels.quantize_nvfp4(x, 0.003), sim.quantize_nvfp4(x, 0.003))
    g = torch.rand(shape[:-1] + (1,), generator=gen).to(device) * 0.01
    assert_same(kernels.quantize_nvfp4(x, g), sim.quantize_nvfp4(x, g))


def test_nvfp4_every_scale_byte_and_tie(device: str) -> None:
    """Blocks whose amax / 6 is each E4M3 value, holding every tie point; with and without a global scale."""
    blocks = every_scale_byte_blocks()
    x = blocks.reshape(-1, 64) if blocks.numel() % 64 == 0 else blocks.reshape(-1, 16)
    x = x.to(device)
    assert_same(kernels.quantize_nvfp4(x), sim.quantize_nvfp4(x))
    for g in (2.0**-9, 0.37, 3.0):
        assert_same(kernels.quantize_nvfp4(x, g), sim.quantize_nvfp4(x, g))
    assert_same(kernels.quantize_nvfp4_rows(x), sim.quantize_nvfp4_rows(x))
    bytes_seen = sim.quantize_nvfp4(x).scale_bytes().unique()
    assert bytes_seen.numel() >= 100  # the scale bytes really were exercised


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_random_and_special_bytes(device: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 320, generator=gen) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=gen))
    wide = torch.randn(2, 8448, generator=gen)  # walked in 256-wide chunks
    for t in (x, x.bfloat16(), special_rows(32), wide):
        t = t.to(device)
        assert_same(kernels.quantize_mxfp4(t, mode), sim.quantize_mxfp4(t, mode))


def test_nvfp4_rows_largest_scaled_values(device: str) -> None:
    """Row-global NVFP4 skips the saturation of |x / scale| at 6 (it is at most 6.4 there): blocks whose amax / 6
    lies just below each midpoint between E4M3 values, so that the scale rounds down by the most and the block's
    amax quantizes from its largest |x / scale|, beside a block that sets the row's global scale."""
    finite = E4M3_VALUES[torch.isfinite(E4M3_VALUES) & (E4M3_VALUES >= 2.0**-6)].double().sort().values
    mid = (finite[:-1] + finite[1:]) / 2
    below = (mid * (1 - 2.0**-20)).float()  # amax / (6 g) just under each midpoint (g = 1: the first block's amax)
    rows = torch.zeros(below.numel(), 32)
    rows[:, 0] = 2688.0
    rows[:, 16] = 6 * below
    rows[:, 17] = -6 * below
    rows[:, 18:32] = 6 * below[:, None] * torch.linspace(-1, 1, 14)
    x = rows.to(device)
    q = kernels.quantize_nvfp4_rows(x)
    assert_same(q, sim.quantize_nvfp4_rows(x))
    assert torch.equal(q.packed[:, 8].cpu() & 0x77, torch.full((below.numel(),), 0x77, dtype=torch.uint8))


def test_nvfp4_given_global_scale_that_overflows_the_reciprocal(device: str) -> None:
    """A tiny given global scale makes 1 / (global * scale) overflow to inf for a block of zeros (0 * inf is NaN,
    code 7) but not for its neighbours: the kernel takes its per-element path for such a program."""
    x = torch.zeros(4, 64)
    x[1:, 16:32] = torch.randn(3, 16, generator=torch.Generator().manual_seed(2)) * 1e-3
    x = x.to(device)
    q = kernels.quantize_nvfp4(x, 1e-38)
    assert_same(q, sim.quantize_nvfp4(x, 1e-38))
    assert (q.packed[0].cpu() == 0x77).all()  # NaN codes from the overflowed reciprocal


SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 3.0e38]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 5), blocks=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1),
       log2_range=st.integers(0, 60), specials=st.integers(0, 4))
def test_quantizers_equal_the_sim_on_any_input(device: str, rows: int, blocks: int, dtype: torch.dtype, seed: int,
                                               log2_range: int, specials: int) -> None:
    """Every quantizer's bytes (and fake-quant values) equal the sim's for random shapes, magnitudes spread over
    2^+-log2_range per element, and special values (signed zeros, infinities, NaN, subnormals, near-max floats) at
    random places: the tiles' index arithmetic, the block-level NaN / inf handling and the float32 encoder against
    the reference on any input (rows wider than one pass: the fixed-shape tests)."""
    gen = torch.Generator().manual_seed(seed)
    K = 16 * blocks
    x = torch.randn(rows, K, generator=gen) * torch.exp2(torch.randint(-log2_range, log2_range + 1, (rows, K),
                                                                          generator=gen).float())
    for _ in range(specials):
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=gen))] = SPECIALS[
            int(torch.randint(len(SPECIALS), (1,), generator=gen))]
    x = x.to(dtype).to(device)
    assert_same(kernels.quantize_nvfp4_rows(x), sim.quantize_nvfp4_rows(x))
    assert_same(kernels.quantize_nvfp4(x), sim.quantize_nvfp4(x))
    g = (torch.rand(rows, 1, generator=gen) * 0.1 + 1e-6).to(device)
    assert_same(kernels.quantize_nvfp4(x, g), sim.quantize_nvfp4(x, g))
    dq, q = kernels.fake_quantize_nvfp4_rows(x)
    dq_ref, q_ref = sim.fake_quantize_nvfp4_rows(x)
    assert_same(q, q_ref)
    if dtype != torch.bfloat16 or device == "cuda":
        assert same_bits(dq.float(), dq_ref.float())
    else:  # the CPU interpreter's float32 -> bf16 cast truncates (on CUDA: the same bits, above)
        torch.testing.assert_close(dq.float(), dq_ref.float(), rtol=1e-2, atol=0, equal_nan=True)
    if K % 32 == 0:
        for mode in ("floor", "rceil"):
            assert_same(kernels.quantize_mxfp4(x, mode), sim.quantize_mxfp4(x, mode))


def test_nvfp4_special_rows(device: str) -> None:
    x = special_rows(16).to(device)
    assert_same(kernels.quantize_nvfp4_rows(x), sim.quantize_nvfp4_rows(x))
    assert_same(kernels.quantize_nvfp4(x), sim.quantize_nvfp4(x))
    assert_same(kernels.quantize_nvfp4(x, 0.01), sim.quantize_nvfp4(x, 0.01))
    q = kernels.quantize_nvfp4_rows(x)
    assert q.dequantize()[3:6].isnan().all() and q.dequantize()[6].eq(0).all()  # non-finite rows stay NaN


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_every_exponent_near_powers_of_two(device: str, mode: str) -> None:
    """amax just above 6 * 2^e for every e: where torch's rounded log2 decides RCEIL's exponent."""
    mants = torch.tensor([0, 1, 2, 3, 5, 6, 11, 12, 22, 23, 44, 45, 1000, 2**23 - 1], dtype=torch.int32)
    exps = torch.arange(-126, 126, dtype=torch.int32)
    bits = ((exps[:, None] + 127) << 23) | mants[None, :]  # v = 2^e (1 + m 2^-23)
    v = bits.view(torch.float32).reshape(-1)
    amax = torch.cat([v * 6.0, v, torch.tensor([2.0**-130, 2.0**-127 * 1.0001, 1e-45])])
    x = torch.zeros(amax.numel(), 32)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    x[:, 2] = amax / 7
    x = x[torch.isfinite(amax)].to(device)
    assert_same(kernels.quantize_mxfp4(x, mode), sim.quantize_mxfp4(x, mode))
    assert math.isfinite(float(x.abs().max()))


def test_pack_parity_matches_sim(device: str) -> None:
    q = sim.quantize_nvfp4_rows(torch.randn(4, 3, 96, generator=torch.Generator().manual_seed(4)).to(device))
    assert torch.equal(kernels.pack_parity(q.packed).cpu(), sim.pack_parity(q.packed).cpu())


def test_kernels_reject_bad_input(device: str) -> None:
    with pytest.raises(ValueError):
        kernels.quantize_nvfp4_rows(torch.randn(2, 24, device=device))
    with pytest.raises(ValueError):
        kernels.quantize_mxfp4(torch.randn(2, 32, device=device), "round")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 4, 96), (2, 8448)])  # one pass; rows walked in chunks
def test_fake_quantize_rows_value_and_record(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 3).to(dtype).to(device)
    dq, q = kernels.fake_quantize_nvfp4_rows(x)
    dq_ref, q_ref = sim.fake_quantize_nvfp4_rows(x)
    assert_same(q, q_ref)
    assert dq.dtype == dtype and dq.shape == x.shape
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(dq, dq_ref)  # same op order; (the CPU interpreter's bf16 cast is not RNE)
    else:
        torch.testing.assert_close(dq, dq_ref, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_operand_is_code_times_block_scale(device: str, dtype: torch.dtype) -> None:
    """The GEMM operand is exactly code * block scale (the quant reference's dequantize with the global left
    out), in dtype with no rounding; the bytes and globals are quantize_nvfp4_rows's. One-pass and chunked rows,
    ties, specials (a NaN scale byte gives NaN), every normal scale byte (one row of all the E4M3 blocks, whose
    global is 1)."""
    gen = torch.Generator().manual_seed(12)
    wide = torch.randn(3, 5, 64, generator=gen) * torch.exp2(torch.randint(-30, 30, (3, 5, 1), generator=gen))
    chunked = torch.randn(2, 8448, generator=gen) * 100
    for x in (wide, wide.bfloat16(), special_rows(16), chunked, every_scale_byte_blocks().reshape(1, -1)):
        x = x.to(device)
        q, operand = quantize_nvfp4_rows_operand(x, dtype)
        assert_same(q, kernels.quantize_nvfp4_rows(x))
        assert_same(q, sim.quantize_nvfp4_rows(x))
        expected = NVFP4(packed=q.packed, scales=q.scales, global_scale=None).dequantize()
        assert operand.dtype == dtype and operand.shape == x.shape
        torch.testing.assert_close(operand.float(), expected, rtol=0, atol=0, equal_nan=True)
