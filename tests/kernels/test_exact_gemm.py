"""trace_exact's Triton GEMMs: the W4A4 kernel gives the exact reference arithmetic's bits and those of integer sums
over ml_dtypes' decoding, whatever rows share the launch; the tree kernel gives the halving tree's bits, which a
plain sum does not (rtol=0, atol=0)."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from trace_lightning.exact import ExactForward, arith
from trace_lightning.exact.forward import quantize_rows
from trace_lightning.kernels.exact import exact_fp4_gemm, exact_tree_bmm, exact_tree_matmul, group_tiles
from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.quant import NVFP4, quantize_weight
from trace_lightning.sim._weights import row_globals


def _operands(P: int, N: int, K: int, device: str, groups: int = 0, seed: int = 0) -> tuple[NVFP4, NVFP4]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, K, generator=g) * torch.logspace(-3, 2, P)[:, None]
    x[0, :16] = 0.0  # an all-zero block
    w = torch.randn(*((groups,) if groups else ()), N, K, generator=g) * 0.05
    return quantize_rows(x.to(device)), quantize_weight(w.to(device), "nvfp4")


def _reference(xq: NVFP4, wq: NVFP4) -> torch.Tensor:
    return arith.fp4_matmul(arith.fp4_integers(xq), arith.fp4_integers(wq), xq.global_scale.reshape(-1),
                            row_globals(wq))


@pytest.mark.parametrize(("P", "N", "K"), [(5, 24, 64), (19, 70, 160), (3, 9, 2080)])
def test_kernel_equals_the_exact_reference(P: int, N: int, K: int, device: str) -> None:
    xq, wq = _operands(P, N, K, device)
    torch.testing.assert_close(exact_fp4_gemm(xq, wq), _reference(xq, wq), rtol=0, atol=0)


def test_kernel_equals_integer_sums_of_ml_dtypes_values(device: str) -> None:
    """The oracle: ml_dtypes decodes every E2M1 code and E4M3 scale, Python sums the products exactly (fractions),
    then the sum times the row globals in float64, rounded once to float32."""
    xq, wq = _operands(4, 6, 48, device, seed=3)

    def values(q: NVFP4) -> list[list[Fraction]]:
        codes = q.codes().cpu().numpy().astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        scales = q.scales.cpu().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        local = codes.reshape(*codes.shape[:-1], -1, 16) * scales[..., None]  # exact: <= 6 significant bits
        return [[Fraction(float(v)) for v in row] for row in local.reshape(codes.shape)]

    xs, ws = values(xq), values(wq)
    xg, wg = xq.global_scale.reshape(-1).double().cpu().numpy(), row_globals(wq).double().cpu().numpy()
    expected = torch.tensor([[np.float32(np.float64(sum(a * b for a, b in zip(xr, wr, strict=True))) * xg[i] * wg[j])
                              for j, wr in enumerate(ws)] for i, xr in enumerate(xs)])
    torch.testing.assert_close(exact_fp4_gemm(xq, wq).cpu(), expected, rtol=0, atol=0)


def test_a_row_gets_the_same_bits_in_any_batch(device: str) -> None:
    xq, wq = _operands(21, 40, 96, device, seed=5)
    full = exact_fp4_gemm(xq, wq)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20)):
        part = NVFP4(packed=xq.packed[rows], scales=xq.scales[rows], global_scale=xq.global_scale[rows])
        torch.testing.assert_close(exact_fp4_gemm(part, wq), full[rows], rtol=0, atol=0)


def test_grouped_rows_get_their_own_groups_bits(device: str) -> None:
    counts = torch.tensor([3, 0, 17, 1, 0, 20], device=device)
    xq, wq = _operands(int(counts.sum()), 32, 64, device, groups=6, seed=7)
    out = exact_fp4_gemm(xq, wq, counts)
    torch.testing.assert_close(out, arith.grouped_fp4_linear(None, xq, None, arith.fp4_integers(wq), row_globals(wq),
                                                             counts), rtol=0, atol=0)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        alone = NVFP4(packed=wq.packed[e], scales=wq.scales[e], global_scale=row_globals(wq)[e][:, None])
        part = NVFP4(packed=xq.packed[rows], scales=xq.scales[rows], global_scale=xq.global_scale[rows])
        torch.testing.assert_close(out[rows], exact_fp4_gemm(part, alone), rtol=0, atol=0)
        start += n


def test_group_tiles_cover_every_row_once() -> None:
    counts = torch.tensor([3, 0, 17, 1, 0, 20])
    group, start, end = group_tiles(counts, int(counts.sum()), block_m=8)
    covered = torch.zeros(int(counts.sum()), dtype=torch.int64)
    bounds = torch.cumsum(counts, 0)
    for g, s, e in zip(group.tolist(), start.tolist(), end.tolist(), strict=True):
        if s < e:
            covered[s:e] += 1
            assert bounds[g] - counts[g] <= s and e <= bounds[g] and e - s <= 8  # within one group
    assert torch.equal(covered, torch.ones_like(covered))


def test_mismatched_shapes_are_named(device: str) -> None:
    xq, wq = _operands(2, 8, 64, device)
    _, wide = _operands(2, 8, 96, device)
    with pytest.raises(ValueError, match="K a multiple of 16 on both sides, got 64 and 96"):
        exact_fp4_gemm(xq, wide)
    _, stack = _operands(2, 8, 64, device, groups=2)
    with pytest.raises(ValueError, match="needs the rows' counts"):
        exact_fp4_gemm(xq, stack)


def test_training_forward_on_the_kernel_equals_torchs_with_its_gradients(device: str) -> None:
    """trace_exact's training forward (master weights, autograd) with its FP4 products on the kernel: the logits and
    every gradient equal those of the torch GEMMs'."""
    torch.manual_seed(0)
    master = Transformer(MoEConfig.from_name("debug-moe", n_layers=1)).to(device)
    ids = torch.randint(1, 128, (2, 7), device=device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 5:] = False
    results = []
    for kernels in ("torch", "triton"):
        master.zero_grad(set_to_none=True)
        logits = ExactForward(master, torch.float32, kernels=kernels)(ids, attention_mask=mask).logits
        logits.float().log_softmax(-1)[..., 3].sum().backward()
        grads = {k: p.grad.clone() for k, p in master.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (logits, grads), (kernel_logits, kernel_grads) = results
    torch.testing.assert_close(kernel_logits, logits, rtol=0, atol=0)
    assert grads.keys() == kernel_grads.keys() and any("w13" in k for k in grads)
    for k in grads:
        torch.testing.assert_close(kernel_grads[k], grads[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 1), (3, 5, 7), (9, 70, 100), (2, 3, 4096), (4, 6, 5000)])
def test_tree_kernel_equals_the_halving_tree(M: int, N: int, K: int, device: str) -> None:
    g = torch.Generator().manual_seed(K)
    a = (torch.randn(M, K, generator=g) * torch.logspace(-4, 4, K)).to(device)  # wide magnitudes: order shows
    b = torch.randn(N, K, generator=g).to(device)
    out = exact_tree_matmul(a, b)
    torch.testing.assert_close(out, arith.tree_matmul(a, b), rtol=0, atol=0)
    if K >= 100:  # a sequential float64-rounded sum is another number: the test sees the order
        assert not torch.equal(out, (a.double() @ b.double().T).float())


def test_tree_kernel_rows_are_batch_invariant(device: str) -> None:
    a, b = torch.randn(13, 48, device=device), torch.randn(20, 48, device=device)
    full = exact_tree_matmul(a, b)
    torch.testing.assert_close(exact_tree_matmul(a[5:6], b), full[5:6], rtol=0, atol=0)
    torch.testing.assert_close(exact_tree_matmul(a[2:11], b[3:17]), full[2:11, 3:17], rtol=0, atol=0)


def test_tree_bmm_kernel_takes_heads_groups_and_strides(device: str) -> None:
    """Grouped-query heads (8 query heads over 2 key heads), and b as a transposed view (the P V product's v)."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 8, 5, 40, generator=g).to(device)
    v = torch.randn(3, 40, 2, 24, generator=g).to(device)  # (B, S, Hkv, Dh)
    b = v.permute(0, 2, 3, 1)  # (B, Hkv, Dh, S): strided
    torch.testing.assert_close(exact_tree_bmm(a, b), arith.tree_bmm(a, b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="Hb dividing H"):
        exact_tree_bmm(a, b[:, :, :, :39])


def test_attention_on_the_kernel_equals_torchs(device: str) -> None:
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, T, H, 16, generator=g).to(device) for T, H in ((5, 4), (9, 2), (9, 2)))
    allowed = torch.rand(2, 5, 9, generator=g).to(device) < 0.6
    allowed[:, :, 0] = True
    want = arith.attention(q, k, v, allowed, 0.25)
    torch.testing.assert_close(arith.attention(q, k, v, allowed, 0.25, exact_tree_bmm), want, rtol=0, atol=0)
