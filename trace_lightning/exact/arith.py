"""Batch- and split-invariant arithmetic: a row's result never depends on the rows beside it or on masked keys.

BLAS GEMMs pick their blocking (and so their float summation order) by the call's shape, so a token's logits
change with the batch it shares and with prefill versus decode. Here every reduction has one fixed order:

- FP4 x FP4 GEMMs run in float64 on integers. An NVFP4 element is (2 * E2M1 value) * (E4M3 scale * 2^9) * 2^-10
  times its row's global scale, and both bracketed factors are integers; a product of two elements' integers is
  below 2^43, so any sum of up to 1024 of them is an exact float64 integer, whatever order BLAS adds them in.
  One rounding to float32 follows, elementwise.
- Every other reduction (dense GEMMs, q.k, P.V, norms, softmax sums) is a halving tree over the reduced dim,
  zero-padded to a power of two: x[:h] + x[h:], repeated. Appended zeros (masked keys) leave the result as it
  is, so attention over a query's own keys gives the same bits whether 3 or 300 masked keys follow.

Backwards are the plain float32 gradients of the same maths (straight-through for the FP4 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trace_lightning.quant import NVFP4, decode_e2m1
from trace_lightning.quant.blocks import split_blocks
from trace_lightning.quant.e2m1 import E2M1_MAX

EXACT_K = 1024
"""The longest reduction whose FP4 integer products sum exactly in float64 (12 * 12 * (448 * 2^9)^2 * 1024 < 2^53);
longer ones add exact 1024-wide partials in a fixed order."""
TREE_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 27}
"""Elements of the product tensor a dense tree GEMM materializes at once: 16 MiB of float32 on the CPU, 512 MiB on a
GPU (fewer, larger launches: the small-moe lm head is 17M products a row). Chunking never changes an output's bits."""


def tree_sum(x: Tensor) -> Tensor:
    """Sum over the last dim by a halving tree, zero-padded to a power of two (appended zeros change nothing)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def tree_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [N, K].T in float32, each output a tree_sum of its K products (row-invariant): chunked over rows,
    and over columns where one row's products exceed the device's chunk."""
    M, (N, K) = a.shape[0], b.shape
    budget = TREE_CHUNK_ELEMENTS.get(a.device.type, TREE_CHUNK_ELEMENTS["cpu"])
    cols = N if N * K <= budget else max(1, budget // max(K, 1))
    rows = max(1, budget // max(cols * K, 1))
    if cols == N:
        parts = [tree_sum(a[i : i + rows, None, :] * b[None]) for i in range(0, M, rows)]
        return torch.cat(parts) if parts else a.new_zeros(0, N)
    out = a.new_empty(M, N)
    for i in range(0, M, rows):
        for j in range(0, N, cols):
            out[i : i + rows, j : j + cols] = tree_sum(a[i : i + rows, None, :] * b[None, j : j + cols])
    return out


def fp4_integers(q: NVFP4) -> Tensor:
    """float64 [..., K] integers (2 * E2M1 value) * (E4M3 scale * 2^9): 2^-10 times the value before the global."""
    values = decode_e2m1(q.codes(), checked=False).unflatten(-1, (-1, q.block_size))
    local = (values * q.scales.float().unsqueeze(-1)).flatten(-2)  # exact: 2 x 4 significant bits
    return local.double() * 1024.0


def fp4_matmul(ia: Tensor, ib: Tensor, a_global: Tensor, b_global: Tensor) -> Tensor:
    """a [..., M, K] @ b [..., N, K].T of FP4 integers (fp4_integers) with row globals a_global [..., M], b_global
    [..., N] -> float32 [..., M, N], rounded once per output from an exact float64 integer sum (any BLAS order, and
    any batching of leading dims, gives the same bits)."""
    K = ia.shape[-1]
    total = ia[..., :EXACT_K] @ ib[..., :EXACT_K].transpose(-1, -2)
    for k in range(EXACT_K, K, EXACT_K):  # fixed order over exact partials
        total = total + ia[..., k : k + EXACT_K] @ ib[..., k : k + EXACT_K].transpose(-1, -2)
    scaled = total * 2.0**-20 * a_global.double()[..., :, None] * b_global.double()[..., None, :]
    return scaled.float()


class _Straight(torch.autograd.Function):
    """value forward; the gradient passes to x where `inside` (the fake-quant straight-through estimate)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, inside: Tensor) -> Tensor:
        ctx.save_for_backward(inside)
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None


def straight_through(x: Tensor, q: NVFP4) -> Tensor:
    """float32 dequantized q with x's straight-through gradient (zero where x was clamped), as fake_quantize."""
    value = q.dequantize(torch.float32)
    if not x.requires_grad:
        return value
    inside = (q.scale_input(split_blocks(x.detach(), q.block_size)).abs() <= E2M1_MAX).reshape(x.shape)
    return _Straight.apply(x, value, inside)


class _Gemm(torch.autograd.Function):
    """forward(a [M, K], b [N, K]) = compute(), exactly; backward: the float32 gradients of a @ b.T."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, compute: Callable[[], Tensor]) -> Tensor:
        ctx.save_for_backward(a, b)
        return compute()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        grad_a = grad @ b if ctx.needs_input_grad[0] else None
        grad_b = grad.T @ a if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def dense_linear(x: Tensor, w: Tensor, matmul: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """x [..., K] @ w [N, K].T in float32 with tree reductions (router, lm head, unquantized layers), by tree_matmul or
    `matmul` (the Triton kernel: the same bits)."""
    a, b, matmul = x.reshape(-1, x.shape[-1]).float(), w.float(), matmul or tree_matmul
    y = _Gemm.apply(a, b, lambda: matmul(a.detach(), b.detach()))
    return y.view(*x.shape[:-1], w.shape[0])


def fp4_linear(x_value: Tensor, xq: NVFP4, w_value: Tensor | None, w_ints: Tensor, w_global: Tensor) -> Tensor:
    """The W4A4 product of activation rows xq [M, K] (values x_value) and a weight's FP4 integers w_ints [N, K] (row
    globals w_global; values w_value for the backward, None without one) -> float32 [M, N]."""
    compute = lambda: fp4_matmul(fp4_integers(xq), w_ints, xq.global_scale.reshape(-1), w_global)  # noqa: E731
    return exact_product(compute, x_value, w_value)


def exact_product(compute: Callable[[], Tensor], x_value: Tensor, w_value: Tensor | None,
                  counts: Tensor | None = None, slots: tuple[Tensor, Tensor, int] | None = None) -> Tensor:
    """compute()'s exact W4A4 product (by this module's GEMMs or the Triton kernel, the same bits) with the float32
    gradients of x_value @ w_value.T (each row through its group's weight w_value [G, N, K] where `counts` rows a
    group are given; `slots`: their group_slots, if already at hand); without w_value, no gradient."""
    if w_value is None:
        return compute()
    if counts is None:
        return _Gemm.apply(x_value, w_value, compute)
    return _GroupedGemm.apply(x_value, w_value, slots or group_slots(counts), compute)


class _GroupedGemm(torch.autograd.Function):
    """forward(x [P, K] rows of groups, w [G, N, K]) = compute(), exactly; backward: the float32 gradients of each
    row's x @ w[group].T, by batched matmuls over the zero-padded groups."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, slots: tuple[Tensor, Tensor, int], compute: Callable[[], Tensor]
                ) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.slots = slots
        return compute()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        grad_pad = padded(grad, ctx.slots, w.shape[0])  # [G, C, N]
        grad_x = torch.bmm(grad_pad, w)[ctx.slots[0], ctx.slots[1]] if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad_pad.transpose(1, 2), padded(x, ctx.slots, w.shape[0])) if ctx.needs_input_grad[1] \
            else None
        return grad_x, grad_w, None, None


def group_slots(counts: Tensor) -> tuple[Tensor, Tensor, int]:
    """For rows sorted by group with `counts` rows a group: (each row's group, its place in the group, the largest
    group's size): where each row goes in a zero-padded [groups, largest, ...] tensor."""
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(group.numel(), device=counts.device) - starts[group]
    return group, place, int(counts.max()) if counts.numel() else 0


def padded(rows: Tensor, slots: tuple[Tensor, Tensor, int], groups: int) -> Tensor:
    """rows [P, ...] sorted by group -> [groups, largest, ...], zeros past each group's rows."""
    group, place, largest = slots
    out = rows.new_zeros(groups, largest, *rows.shape[1:])
    out[group, place] = rows
    return out


def grouped_fp4_linear(x_value: Tensor, xq: NVFP4, w_value: Tensor | None, w_ints: Tensor, w_global: Tensor,
                       counts: Tensor) -> Tensor:
    """fp4_linear of activation rows sorted by group (`counts` a group: an MoE's experts) through each group's own
    weight, w_ints [G, N, K] (globals [G, N], values [G, N, K] or None) -> float32 [P, N]. One batched float64 GEMM
    over the zero-padded groups: its sums are exact integers, so a row's result is what fp4_linear gives it alone,
    whatever its group's size or the other groups (a Python loop over experts launched ~20 kernels an expert)."""
    slots, G = group_slots(counts), w_ints.shape[0]

    def compute() -> Tensor:  # padded rows are zeros with zero globals: they never reach a real row
        ints, globals_ = padded(fp4_integers(xq), slots, G), padded(xq.global_scale.reshape(-1), slots, G)
        return fp4_matmul(ints, w_ints, globals_, w_global)[slots[0], slots[1]]

    return exact_product(compute, x_value, w_value, counts, slots)


def rms_norm(x: Tensor, weight: Tensor, eps: float, rnd: Callable[[Tensor], Tensor]) -> Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) with a tree mean; rnd rounds to the compute dtype as the model does."""
    ms = tree_sum(x * x) / x.shape[-1]
    normed = rnd(x * (1.0 / torch.sqrt(ms + eps))[..., None])
    return rnd(weight.float() * normed)


class _TreeBmm(torch.autograd.Function):
    """forward(a [B, H, M, K], b [B, Hb, N, K]) = tree_bmm(a, b), exactly (head h through b's head h // (H / Hb));
    backward: the float32 gradients of a @ b.T (b's summed over its group of heads)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, tree_bmm: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        ctx.save_for_backward(a, b)
        return tree_bmm(a.detach(), b.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        B, H, Hb = a.shape[0], a.shape[1], b.shape[1]
        grad_a = grad @ b.repeat_interleave(H // Hb, dim=1) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = (grad.transpose(-1, -2) @ a).view(B, Hb, H // Hb, *b.shape[2:]).sum(dim=2)
        return grad_a, grad_b, None


def tree_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a [B, H, M, K] @ b [B, Hb, N, K].T -> [B, H, M, N] float32, head h through b's head h // (H / Hb), each output a
    tree_sum of its K products (kernels.exact.exact_tree_bmm computes the same bits without the products tensor)."""
    b = b.repeat_interleave(a.shape[1] // b.shape[1], dim=1)
    return tree_sum(a[:, :, :, None, :].float() * b[:, :, None, :, :].float())


def attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float,
              bmm: Callable[[Tensor, Tensor], Tensor] = tree_bmm) -> Tensor:
    """q (B, T, Hq, Dh), k / v (B, S, Hkv, Dh), allowed (B, T, S) -> (B, T, Hq, Dh) float32: scores and the P V sum
    are tree reductions and masked keys contribute exact zeros, so the result depends on the allowed keys only. The
    two tree products run as `bmm` (tree_bmm, or the Triton kernel: the same bits); their backward is plain
    matmuls."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T or S, Dh)
    scores = _TreeBmm.apply(qh, kh, bmm) * scale  # (B, Hq, T, S)
    mask = allowed[:, None]  # (B, 1, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.detach().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = torch.exp(scores - top).masked_fill(~mask, 0.0)
    p = e / tree_sum(e)[..., None].clamp_min(torch.finfo(torch.float32).tiny)
    return _TreeBmm.apply(p, vh.transpose(-1, -2), bmm).transpose(1, 2)  # (B, T, Hq, Dh)
