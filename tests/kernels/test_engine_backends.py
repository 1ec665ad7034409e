"""The FP4 engine on the Triton backend (under TRITON_INTERPRET=1 on the CPU) against the sim engine, end to end.

In float32 compute the two backends differ only in fp32 summation order, so greedy tokens must be the same and
logprobs agree to a few fp32 ulps of their magnitude. In bf16 the backends round intermediate values at different
points and a random FP4 model amplifies that (sim bf16 against sim fp32 moves first-token logprobs by up to 0.3),
so there the check is TRACE's own: the Triton engine's records guide training to the Triton engine's codes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from trace_lightning.guidance import GuidedHook, QuantRecord, collate_records
from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams

PROMPTS = [[1, 5, 6, 7], [1, 3, 4, 5, 6, 7, 8, 40, 41]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer.from_name("debug-moe", n_layers=2, init_std=0.08).eval()


def _generate(model: Transformer, backend: str, dtype: torch.dtype, device: str, temperature: float) -> RolloutBatch:
    engine = Engine(copy.deepcopy(model).to(device), FP4Precision(compute_dtype=dtype), backend=backend,
                    cuda_graph=False)
    params = SamplingParams(max_new_tokens=5, temperature=temperature, seed=3)
    return engine.generate(PROMPTS, params, capture=CaptureSpec(mode="full"))


@pytest.mark.slow  # the whole engine under the interpreter: CI runs it in its slow pass
def test_triton_engine_equals_the_sim_engine_in_fp32(model: Transformer, device: str) -> None:
    triton, sim = (_generate(model, b, torch.float32, device, 0.0) for b in ("triton", "sim"))
    assert triton.responses == sim.responses
    for a, b in zip(triton.logprobs, sim.logprobs, strict=True):
        # logprobs of magnitude < 10 summed over a vocabulary of 128 in fp32: a few ulps (2^-20 at 8) apart
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    for ours, theirs in zip(triton.routes, sim.routes, strict=True):
        assert torch.equal(ours.cpu(), theirs.cpu())


@pytest.mark.slow  # the whole engine under the interpreter: CI runs it in its slow pass
def test_triton_records_guide_training_to_the_triton_codes(model: Transformer, device: str) -> None:
    out = _generate(model, "triton", torch.bfloat16, device, 1.0)
    seqs = [p + r for p, r in zip(PROMPTS, out.responses, strict=True)]
    width = max(len(s) for s in seqs)
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)[:, :-1]
    mask = torch.tensor([[True] * len(s) + [False] * (width - len(s)) for s in seqs], device=device)[:, :-1]
    audit = out.record.window(tokens.shape[1])  # the packed record the Triton kernels wrote, as the worker cuts it
    guide = audit.compact("parity")
    full = [QuantRecord.from_captures(c, r, out.policy_version) for c, r in zip(out.captures, out.routes, strict=True)]
    assert torch.equal(collate_records(full, tokens.shape[1]).data.cpu(), audit.data.cpu())  # the bytes transport's
    hook = GuidedHook("nvfp4", guide, "parity", mask, audit=audit)
    with torch.no_grad():  # training's forward: the fp32 master model, routes replayed
        model.to(device)(tokens, attention_mask=mask, hook=hook, routed=guide.routes_for_replay())
    metrics = hook.metrics()
    assert len([k for k in metrics if k.startswith("quant/value_agreement/")]) == 2 * 6  # every site of 2 layers
    assert metrics["quant/value_agreement"] == 1.0
