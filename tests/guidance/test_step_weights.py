"""A step's micro-batches share their fake-quantized weights (FakeQuantCache): the same values and gradients as
quantizing per micro-batch, and a weight changed in place is quantized anew."""

from __future__ import annotations

import torch

from trace_lightning.guidance import FakeQuantHook
from trace_lightning.model import Transformer
from trace_lightning.quant import FakeQuantCache, fake_quantize, parse_format, quantize_weight


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

