"""A step's micro-batches share their fake-quantized weights (FakeQuantCache): the same values and gradients as
quantizing per micro-batch, and a weight changed in place is quantized anew."""

from __future__ import annotations

import torch

from trace_lightning.guidance import FakeQuantHook
from trace_lightning.model import Transformer
from trace_lightning.quant import FakeQuantCache, fake_quantize, parse_format, quantize_weight
from trace_lightning.quant.fake import fake_quantized


def _grads(shared: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    policy = Transformer.from_name("debug-moe")
    tokens = torch.randint(0, policy.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    cache = FakeQuantCache()
    for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches of one step
        hook = FakeQuantHook("nvfp4", weights=cache if shared else None)
        policy(tokens[rows], hook=hook).float().logsumexp(-1).mean().backward()
    if shared:
        assert len(cache) > 0  # the second micro-batch read the first one's weights
    return {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}


def test_shared_weights_give_the_gradients_of_per_micro_batch_quantization() -> None:
    fresh, shared = _grads(shared=False), _grads(shared=True)
    assert fresh.keys() == shared.keys() and len(fresh) > 0
    for name in fresh:
        torch.testing.assert_close(shared[name], fresh[name], rtol=0, atol=0, msg=name)


def test_a_weight_updated_in_place_is_quantized_anew() -> None:
    w = torch.randn(2, 64, 32, requires_grad=True)
    cache, fmt = FakeQuantCache(), parse_format("nvfp4").for_weights()
    first = cache.fake_quantize(w, fmt, layer=0, name="moe.w13")
    with torch.no_grad():
        w.mul_(1.5)  # as an optimizer step updates it
    second = cache.fake_quantize(w, fmt, layer=0, name="moe.w13")
    expected = fake_quantize(w, fmt, quantize_weight(w.detach(), fmt), "full")
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    cache.clear()
    assert len(cache) == 0


def test_under_autocast_the_kept_weights_are_autocasts_cast_with_the_same_gradients() -> None:
    """bf16 training compute: the cache keeps a weight as the GEMM's autocast would cast it each micro-batch, once a
    step; the GEMM's output and the master weight's gradient are those of the fp32 fake-quant value cast by autocast."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(3, 64, 32, generator=g) * 0.05).requires_grad_()
    x = torch.randn(5, 32, generator=g)
    fmt = parse_format("nvfp4").for_weights()

    def run(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, weight[1]) + torch.nn.functional.linear(x, weight[0])
        y.float().pow(2).sum().backward()
        return y, w.grad.clone()

    expected_y, expected_grad = run(fake_quantize(w, fmt, quantize_weight(w.detach(), fmt), "full"))
    cache = FakeQuantCache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = cache.fake_quantize(w, fmt, layer=0, name="moe.w13")
    assert kept.dtype == torch.bfloat16 and w.dtype == torch.float32
    y, grad = run(kept)
    assert y.dtype == expected_y.dtype == torch.bfloat16 and grad.dtype == torch.float32
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    blocked = ~fake_quantized(w.detach(), fmt, quantize_weight(w.detach(), fmt), "full")[1]
    assert bool(blocked.any()) and bool((grad[blocked] == 0).all()) and bool((grad[~blocked] != 0).any())
    # Outside autocast the same weight is the fp32 value again, not the bf16 copy.
    assert cache.fake_quantize(w, fmt, layer=0, name="moe.w13").dtype == torch.float32
