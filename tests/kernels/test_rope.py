"""Triton rope (head RMSNorm + rotate-half RoPE in one launch) against the model's own ops, through its sim twin."""

import pytest
import torch

from trace_lightning import kernels, sim
from trace_lightning.model.model import RMSNorm, apply_rope, rope_cos_sin


def inputs(dtype: torch.dtype, B: int = 3, T: int = 2, H: int = 5, Dh: int = 64, seed: int = 0):  # noqa: ANN201
    """q as the attention gets it: a strided view of a fused projection; cos / sin at scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(B, T, (H + 3) * Dh, generator=gen) * 2).to(dtype)
    x = fused[..., Dh: (H + 1) * Dh].view(B, T, H, Dh)
    positions = torch.randint(0, 4000, (B, T), generator=gen)
    cos, sin = rope_cos_sin(positions, Dh, 1e6, dtype)
    norm = RMSNorm(Dh, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(Dh, generator=gen))
    return x, cos, sin, norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_without_norm_is_the_models_rope_bit_for_bit(device: str, dtype: torch.dtype) -> None:
    x, cos, sin, _ = inputs(dtype, seed=1)
    expected = apply_rope(x, cos, sin)
    torch.testing.assert_close(sim.rope(x, cos, sin), expected, rtol=0, atol=0)
    got = kernels.rope(x.to(device), cos.to(device), sin.to(device)).cpu()
    assert got.dtype == expected.dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [5, 32, 80])  # 80 x 64: two programs per token
def test_rope_with_head_norm_matches_the_models_norm_then_rope(device: str, dtype: torch.dtype, heads: int) -> None:
    x, cos, sin, norm = inputs(dtype, H=heads, seed=heads)
    with torch.no_grad():
        expected = apply_rope(norm(x), cos, sin)
        torch.testing.assert_close(sim.rope(x, cos, sin, norm.weight, 1e-6), expected, rtol=0, atol=0)
        got = kernels.rope(x.to(device), cos.to(device), sin.to(device), norm.weight.to(device), 1e-6).cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # only the norm's float32 sum order differs (kernels.norm): a last-bit difference of the mean, rarely visible
    same = (got == expected).float().mean().item()
    assert same >= (0.99 if dtype == torch.bfloat16 else 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 1.6e-2, atol=1e-6)


def test_rope_rejects_what_it_cannot_rotate(device: str) -> None:
    x = torch.ones(2, 1, 4, 64, device=device)
    trig = torch.ones(2, 1, 64, device=device)
    with pytest.raises(ValueError, match="cos / sin"):
        kernels.rope(x, trig[:, :, :32], trig)
    with pytest.raises(ValueError, match="power-of-two"):
        kernels.rope(torch.ones(2, 1, 4, 48, device=device), trig[..., :48], trig[..., :48])
    with pytest.raises(ValueError, match="norm weight"):
        kernels.rope(x, trig, trig, torch.ones(32, device=device))


def test_attention_takes_the_fused_rope_only_without_autograd(device: str) -> None:
    """The kernel has no backward: with gradients on, attention rotates with torch ops even when fused_rope is set;
    without, it takes the kernel and the logits stay the model's."""
    from trace_lightning.model import Transformer
    from trace_lightning.model.model import Attention

    torch.manual_seed(0)
    model = Transformer.from_name("debug-moe", n_layers=2).to(device)
    ids = torch.randint(3, 100, (2, 6), device=device)
    with torch.no_grad():
        expected = model(ids)
    calls = []
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_rope = lambda *args: calls.append(1) or kernels.rope(*args)
    model(ids).float().sum().backward()
    assert not calls and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        got = model(ids)
    assert len(calls) == 2 * 2  # q and k of both layers
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
