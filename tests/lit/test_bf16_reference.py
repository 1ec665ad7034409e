"""The BF16 reference from the policy itself: a BF16 engine's logprobs, micro-batched, with no second model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import MismatchMonitor, bf16_reference, default_bf16_reference_every
from trace_lightning.lit.config import TraceConfig
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.model.cast import weights_cast_as_they_run
from trace_lightning.rl import mismatch_metrics, token_logprobs
from trace_lightning.rollout import Engine


def make_batch(vocab: int, rows: int = 5, width: int = 12, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    attention = torch.arange(width)[None] < lengths[:, None]
    response = attention[:, 1:] & (torch.arange(1, width)[None] >= 3)
    return TrainBatch(tokens, attention, response, torch.zeros(rows, width - 1), torch.zeros(rows), 1, 0)


@pytest.fixture(scope="module")
def module() -> PolicyModule:
    torch.manual_seed(0)
    return PolicyModule(cpu_threads=1)


def test_the_bf16_side_is_a_bf16_engines_forward_bit_for_bit(module: PolicyModule) -> None:
    """What the reference meant with a second engine, now from the policy: equal logprobs, not close ones."""
    batch = make_batch(module.policy.config.vocab_size)
    engine = Engine(copy.deepcopy(module.policy).eval(), "bf16")
    logits = engine.model(batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1])
    expected = token_logprobs(logits.float(), batch.tokens[:, 1:], module.rollout_cfg.temperature)
    assert torch.equal(module.unquantized_logprobs(batch, torch.bfloat16), expected)
    with torch.no_grad():
        fp32 = module.policy(batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1])
    train = token_logprobs(fp32.float(), batch.tokens[:, 1:], module.rollout_cfg.temperature)
    assert torch.equal(module.unquantized_logprobs(batch), train)
    metrics = bf16_reference(module, batch)
    assert metrics == {key.replace("mismatch/", "mismatch_bf16/"): value
                       for key, value in mismatch_metrics(train, expected, batch.response_mask).items()}
    assert float(metrics["mismatch_bf16/k3_kl"]) > 0  # bf16 really differs from fp32
    assert module._eval_workers == {}  # no BF16 engine was built for it


def test_at_most_one_modules_weights_are_cast_at_a_time_and_the_masters_stay(module: PolicyModule) -> None:
    policy = module.policy
    before = {name: (p, p.detach().clone()) for name, p in policy.named_parameters()}
    largest = max(sum(p.numel() for p in m._parameters.values() if p is not None) for m in policy.modules())
    live: list[int] = []

    def count(m: nn.Module, args: object, output: object) -> None:
        live.append(sum(p.numel() for mod in policy.modules() for p in mod._parameters.values()
                        if p is not None and p.dtype == torch.bfloat16))

    handles = [m.register_forward_hook(count) for m in policy.modules()]
    try:
        module.unquantized_logprobs(make_batch(policy.config.vocab_size), torch.bfloat16)
    finally:
        for h in handles:
            h.remove()
    assert live and 0 < max(live) <= largest < sum(p.numel() for p in policy.parameters()) / 4
    for name, p in policy.named_parameters():
        assert p is before[name][0] and p.dtype == torch.float32 and torch.equal(p, before[name][1]), name


def test_weights_come_back_when_a_forward_raises(module: PolicyModule) -> None:
    policy = module.policy
    params = dict(policy.named_parameters())

    def fail(m: nn.Module, args: object) -> None:
        raise RuntimeError("boom")

    handle = policy.layers[1].moe.experts.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), \
                weights_cast_as_they_run(policy, torch.bfloat16):
            policy(torch.zeros(1, 4, dtype=torch.long))
    finally:
        handle.remove()
    assert dict(policy.named_parameters()) == params
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert not any(h for m in policy.modules() for h in (m._forward_pre_hooks, m._forward_hooks))
    with pytest.raises(ValueError, match="floating-point"), weights_cast_as_they_run(policy, torch.int8):
        pass


def test_the_reference_runs_over_the_training_steps_micro_batches() -> None:
    torch.manual_seed(0)
    module = PolicyModule(cpu_threads=1, micro_batch_size=2, trace=TraceConfig(route_replay=True))
    config = module.policy.config
    batch = make_batch(config.vocab_size, rows=5)
    g = torch.Generator().manual_seed(1)
    batch.routes = [torch.rand(5, 11, config.n_experts, generator=g).argsort(-1)[..., :config.top_k]
                    for _ in range(config.n_layers)]
    seen: list[tuple[int, torch.dtype]] = []
    handle = module.policy.register_forward_pre_hook(
        lambda m, args: seen.append((args[0].shape[0], m.tok_embeddings.weight.dtype)))
    try:
        chunked = bf16_reference(module, batch)
    finally:
        handle.remove()
    assert [rows for rows, _ in seen] == [2, 2, 1, 2, 2, 1]  # both sides, the step's slices
    module.hparams.micro_batch_size = None
    whole = bf16_reference(module, batch)
    for key, value in whole.items():
        torch.testing.assert_close(chunked[key], value, rtol=1e-4, atol=1e-7)
    replayed = module.unquantized_logprobs(batch)
    batch.routes = [(r + 1) % config.n_experts for r in batch.routes]  # other experts: the routes are replayed
    assert not torch.equal(module.unquantized_logprobs(batch), replayed)


def test_the_default_thins_the_reference_by_parameter_count(module: PolicyModule) -> None:
    assert [default_bf16_reference_every(n) for n in (int(1.9e8), int(1.99e9), int(7e9), int(30.5e9),
                                                      int(47e9), int(1e12))] == [1, 1, 7, 31, 47, 50]
    assert MismatchMonitor().reference_every(module) == 1  # debug-moe: about a million parameters
    assert MismatchMonitor(bf16_reference_every=10).reference_every(module) == 10
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="bf16_reference_every"):
            MismatchMonitor(bf16_reference_every=bad)
