"""The invariant arithmetic: a row's bits never depend on its batch, on masked keys, or on BLAS's summation order."""

import pytest
import torch

from trace_lightning.exact import arith, quantize_rows
from trace_lightning.quant import fake_quantize, parse_format, quantize_weight
from trace_lightning.sim._weights import row_globals


def test_tree_sum_ignores_appended_zeros_and_sums_correctly() -> None:
    x = torch.randn(7, 37, generator=torch.Generator().manual_seed(0))
    base = arith.tree_sum(x)
    for extra in (1, 27, 91):
        padded = torch.cat([x, torch.zeros(7, extra)], dim=-1)
        assert torch.equal(arith.tree_sum(padded), base)
    torch.testing.assert_close(base.double(), x.double().sum(-1), rtol=1e-6, atol=1e-6)
    assert arith.tree_sum(torch.ones(3, 1)).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_tree_matmul_rows_match_the_row_alone(rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g)
    full = arith.tree_matmul(a, b)
    alone = torch.cat([arith.tree_matmul(a[i : i + 1], b) for i in range(rows)])
    assert torch.equal(full, alone)
    torch.testing.assert_close(full, a @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [96 * 40, 96 * 7, 50])
def test_tree_matmul_chunks_change_no_bits(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """Chunked over rows (a row's products fit), over columns too (7 a chunk), or one output at a time."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(9, 96, generator=g), torch.randn(40, 96, generator=g)
    whole = arith.tree_matmul(a, b)
    monkeypatch.setitem(arith.TREE_CHUNK_ELEMENTS, "cpu", budget)
    assert torch.equal(arith.tree_matmul(a, b), whole)


def test_fp4_matmul_is_the_exact_integer_sum_rounded_once() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(33, 128, generator=g) * 3, torch.randn(24, 128, generator=g) * 0.05
    xq, wq = quantize_rows(x), quantize_weight(w, "nvfp4")
    ix, iw = arith.fp4_integers(xq), arith.fp4_integers(wq)
    assert torch.equal(ix, ix.round()) and torch.equal(iw, iw.round())  # integers by construction
    exact = ix.long() @ iw.long().T  # int64: no rounding at all
    total = ix @ iw.T
    assert torch.equal(total, exact.double())  # float64 BLAS added them without a rounding
    xg, wg = xq.global_scale.reshape(-1), row_globals(wq)
    y = arith.fp4_matmul(ix, iw, xg, wg)
    alone = torch.cat([arith.fp4_matmul(ix[i : i + 1], iw, xg[i : i + 1], wg) for i in range(33)])
    assert torch.equal(y, alone)
    torch.testing.assert_close(y, xq.dequantize() @ wq.dequantize().T, rtol=1e-5, atol=1e-6)


def test_fp4_matmul_splits_long_reductions_into_exact_partials() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 2048 + 64, generator=g), torch.randn(6, 2048 + 64, generator=g)
    xq, wq = quantize_rows(x), quantize_rows(w)
    y = arith.fp4_matmul(arith.fp4_integers(xq), arith.fp4_integers(wq), xq.global_scale.reshape(-1),
                         wq.global_scale.reshape(-1))
    torch.testing.assert_close(y, xq.dequantize() @ wq.dequantize().T, rtol=1e-5, atol=1e-5)


def test_attention_depends_on_allowed_keys_only() -> None:
    g = torch.Generator().manual_seed(4)
    B, T, S, Hq, Hkv, Dh = 3, 4, 9, 4, 2, 32
    q, k, v = torch.randn(B, T, Hq, Dh, generator=g), torch.randn(B, S, Hkv, Dh, generator=g), torch.randn(
        B, S, Hkv, Dh, generator=g)
    positions = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5], [5, 6, 7, 8]])
    allowed = torch.arange(S) <= positions[..., None]
    out = arith.attention(q, k, v, allowed, Dh**-0.5)
    for b in range(B):
        for t in range(T):
            n = int(positions[b, t]) + 1  # the query alone over exactly its keys, garbage keys dropped
            one = arith.attention(q[b : b + 1, t : t + 1], k[b : b + 1, :n], v[b : b + 1, :n],
                                  torch.ones(1, 1, n, dtype=torch.bool), Dh**-0.5)
            assert torch.equal(out[b, t], one[0, 0])
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None], enable_gqa=True)
    torch.testing.assert_close(out, reference.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("site", ["activation", "weight"])
def test_straight_through_is_fake_quantizes_value_and_gradient(site: str) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g)
    x[0, :16] *= 1e-4  # a block far below its matrix: its E4M3 scale clamps and its values saturate
    fmt = parse_format("nvfp4") if site == "activation" else parse_format("nvfp4").for_weights()
    q = quantize_rows(x) if site == "activation" else quantize_weight(x, "nvfp4")
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    value, reference = arith.straight_through(ours, q), fake_quantize(theirs, fmt)
    assert torch.equal(value, reference)
    grad = torch.randn(6, 64, generator=g)
    assert torch.equal(torch.autograd.grad(value, ours, grad)[0], torch.autograd.grad(reference, theirs, grad)[0])


def test_dense_linear_gradients_are_the_matmuls() -> None:
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 3, 32, generator=g).requires_grad_(), torch.randn(16, 32, generator=g).requires_grad_()
    y = arith.dense_linear(x, w)
    grad = torch.randn(5, 3, 16, generator=g)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    torch.testing.assert_close(gx, grad @ w.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, grad.reshape(-1, 16).T @ x.detach().reshape(-1, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [64, 2080])  # 2080: past EXACT_K, exact partials added in order
def test_grouped_fp4_linear_is_each_rows_own_fp4_linear(K: int) -> None:
    """Experts' rows in one batched GEMM over zero-padded groups: each row's bits are fp4_linear's for that row and its
    expert alone (an empty expert included), and the gradients are each group's matmuls."""
    g = torch.Generator().manual_seed(7)
    counts = torch.tensor([3, 0, 5, 1])
    x = (torch.randn(int(counts.sum()), K, generator=g) * 2).requires_grad_()
    w = torch.randn(4, 24, K, generator=g) * 0.05
    wq = [quantize_weight(w[e], "nvfp4") for e in range(4)]
    ints = torch.stack([arith.fp4_integers(q) for q in wq])
    globals_ = torch.stack([row_globals(q) for q in wq])
    w_value = torch.stack([q.dequantize(torch.float32) for q in wq]).requires_grad_()
    xq = quantize_rows(x.detach())
    y = arith.grouped_fp4_linear(x, xq, w_value, ints, globals_, counts)
    e_of_row = torch.repeat_interleave(torch.arange(4), counts)
    for r in range(x.shape[0]):
        e = int(e_of_row[r])
        row = x[r : r + 1].detach()
        alone = arith.fp4_linear(row, quantize_rows(row), None, ints[e], globals_[e])
        assert torch.equal(y[r : r + 1].detach(), alone), f"row {r}"
    grad = torch.randn(y.shape, generator=g)
    gx, gw = torch.autograd.grad(y, (x, w_value), grad)
    torch.testing.assert_close(gx, torch.einsum("pn,pnk->pk", grad, w_value.detach()[e_of_row]), rtol=1e-5, atol=1e-5)
    want = torch.stack([grad[e_of_row == e].T @ x.detach()[e_of_row == e] for e in range(4)])
    torch.testing.assert_close(gw, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(gw[1]) == 0  # the expert no row picked gets no gradient
