import copy

import pytest
import torch

from trace_lightning.model import QuantHook, Transformer
from trace_lightning.quant import FP4Format
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams, quantize_weight, sequence_seeds

from .conftest import PROMPTS


def full_forward_logprobs(model: Transformer, seq: list[int], hook: QuantHook | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]), hook=hook)[0].float().log_softmax(-1)  # (T, V)


def test_greedy_fp32_equals_full_forward_argmax(model: Transformer, base_model: Transformer) -> None:
    out = Engine(model, "fp32").generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    for p, r, lp in zip(PROMPTS, out.responses, out.logprobs, strict=True):
        assert len(r) == 8
        full = full_forward_logprobs(base_model, p + r)
        for j, t in enumerate(r):
            assert t == int(full[len(p) - 1 + j].argmax())
            assert abs(lp[j] - float(full[len(p) - 1 + j, t])) < 1e-4


def test_routes_align_with_training_forward_over_tokens_minus_last(model: Transformer,
                                                                   base_model: Transformer) -> None:
    out = Engine(model, "fp32").generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    for i, (p, r) in enumerate(zip(PROMPTS, out.responses, strict=True)):
        seq = p + r
        with torch.no_grad():
            routes = base_model(torch.tensor([seq[:-1]]), return_routes=True).routes
        expected = torch.stack([x[0] for x in routes])  # (L, T_b - 1, K)
        assert out.routes[i].shape == (2, out.record_length(i), 2)
        assert torch.equal(out.routes[i], expected)


def test_sampled_logprobs_are_temperature_scaled(model: Transformer, base_model: Transformer) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    out = Engine(model, "fp32").generate(PROMPTS, params)
    for p, r, lp in zip(PROMPTS, out.responses, out.logprobs, strict=True):
        with torch.no_grad():
            logits = base_model(torch.tensor([p + r]))[0].float()
        scaled = (logits / 0.7).log_softmax(-1)
        for j, t in enumerate(r):
            assert abs(lp[j] - float(scaled[len(p) - 1 + j, t])) < 1e-4
            assert t in logits[len(p) - 1 + j].topk(5).indices.tolist()


def test_ragged_batch_equals_each_prompt_alone(model: Transformer) -> None:
    engine = Engine(model, "fp32")
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=11)
    seeds = sequence_seeds(11, len(PROMPTS))
    batch = engine.generate(PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], SamplingParams(max_new_tokens=7, temperature=1.0, seed=[seeds[i]]))
        assert alone.responses[0] == batch.responses[i]
        assert alone.logprobs[0] == pytest.approx(batch.logprobs[i], abs=1e-5)
        assert torch.equal(alone.routes[0], batch.routes[i])


def test_fp4_bf16_ragged_batch_equals_each_prompt_alone(base_model: Transformer) -> None:
    """The product's rollout (FP4 weights, activations and cache, bf16 compute): every sequence of a ragged batch
    decodes token for token and code for code as alone, logprobs to float rounding. Attention reads the packed
    cache up to each query's position only; through SDPA over a window sized by the batch (fused_attention=False)
    1 of these 12 sequences departs in its tokens on this CPU (a bf16 sum over more masked keys moves a code, then
    a token; 3 of 16 on debug-moe with 4 layers)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (12,), generator=g)]
    max_new = [int(m) for m in torch.randint(8, 40, (12,), generator=g)]
    seeds = sequence_seeds(0, len(prompts))
    engine = Engine(copy.deepcopy(base_model), FP4Precision())
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, seed=seeds), capture=CaptureSpec())
    for i, (p, m, s) in enumerate(zip(prompts, max_new, seeds, strict=True)):
        alone = engine.generate([p], SamplingParams(max_new_tokens=[m], seed=[s]), capture=CaptureSpec())
        assert alone.responses[0] == batch.responses[i], i
        assert alone.logprobs[0] == pytest.approx(batch.logprobs[i], abs=1e-5)
        assert torch.equal(alone.routes[0], batch.routes[i])
        for key, q in batch.captures[i].items():
            assert torch.equal(q.packed, alone.captures[0][key].packed), (i, key)


def test_seeded_sampling_is_reproducible(model: Transformer) -> None:
    engine = Engine(model, "fp32")
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=5))
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=5))
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=6))
    assert a.responses == b.responses and a.logprobs == b.logprobs
    assert a.responses != c.responses
    # A sequence's stream depends on its own seed, not on its neighbours.
    d = engine.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=[42, 7]))
    e = engine.generate([PROMPTS[1], PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=[3, 7]))
    assert d.responses[1] == e.responses[1]


def test_sequences_finish_independently(model: Transformer) -> None:
    engine = Engine(model, "fp32", sync_every=2)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0)).responses
    stop = greedy[0][0]
    max_new = [6, 2, 6, 6]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=[stop]))
    for i, (g, m) in enumerate(zip(greedy, max_new, strict=True)):
        hit = next((j + 1 for j, t in enumerate(g[:m]) if t == stop), None)
        assert out.responses[i] == g[: hit or m]
        assert out.finish_reasons[i] == ("length" if hit is None else "stop")
        assert out.routes[i].shape[1] == out.record_length(i) == len(PROMPTS[i]) + len(out.responses[i]) - 1
    assert out.responses[0] == [stop] and out.responses[1] == greedy[1][:2]
    assert "length" in out.finish_reasons


def test_all_rows_stopping_ends_the_loop_early(model: Transformer) -> None:
    engine = Engine(model, "fp32", sync_every=1)
    first = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=1, temperature=0.0)).responses[0][0]
    out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=50, temperature=0.0, stop_token_ids=[first]))
    assert out.responses == [[first]] and out.finish_reasons == ["stop"]
    assert out.stats["decode_steps"] <= 2


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1, 2], []], SamplingParams(max_new_tokens=4), "prompt 1 is empty"),
        ([[1, 2], [3], [1, 128]], SamplingParams(max_new_tokens=4), "prompt 2: token 128 at position 1"),
        ([[1], [-1]], SamplingParams(max_new_tokens=4), "prompt 1: token -1 at position 0"),
        ([[1], [2] * 500], SamplingParams(max_new_tokens=20), "prompt 1: 500 prompt tokens \\+ 20 new tokens"),
        ([[1], [2]], SamplingParams(max_new_tokens=[3, 0]), "prompt 1: max_new_tokens must be >= 1"),
        ([[1], [2]], SamplingParams(max_new_tokens=0), "prompt 0: max_new_tokens must be >= 1"),
    ],
)
def test_bad_inputs_name_the_prompt(model: Transformer, prompts: list[list[int]], params: SamplingParams,
                                    match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(model, "fp32").generate(prompts, params)


def test_bad_sampling_params() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="precision"):
        Engine(Transformer.from_name("debug-moe", n_layers=1), "fp16")


class TrainerFakeQuant(QuantHook):
    """What the trainer's QAT forward does: RNE fake-quant of every site per row, weights per matrix."""

    def __init__(self, kind: str = "nvfp4") -> None:
        self.fmt = FP4Format(kind)

    def activation(self, x: torch.Tensor, *, layer: int, site: str) -> torch.Tensor:
        return self.fmt.quantize(x).dequantize(x.dtype)

    def weight(self, w: torch.Tensor, *, layer: int, name: str) -> torch.Tensor:
        return quantize_weight(w, self.fmt).dequantize(w.dtype)


@pytest.mark.parametrize(("kind", "fused"), [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_fp4_engine_matches_trainer_fake_quant_forward(model: Transformer, base_model: Transformer,
                                                       kind: str, fused: bool) -> None:
    """fp32 FP4 rollout (weights, activations, KV) vs the training-side full forward with fake-quant; fused:
    attention runs on the packed NVFP4 cache (ops.fp4_kv_attention, the Triton default) instead of SDPA."""
    engine = Engine(model, FP4Precision(fmt=kind, compute_dtype="fp32"), fused_attention=fused)
    assert engine.fused_attention is fused
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))
    for p, r, lp in zip(PROMPTS, out.responses, out.logprobs, strict=True):
        full = full_forward_logprobs(base_model, p + r, TrainerFakeQuant(kind))
        expected = [float(full[len(p) - 1 + j, t]) for j, t in enumerate(r)]
        assert lp == pytest.approx(expected, abs=1e-4)


def test_bf16_and_fp4_bf16_engines_run(model: Transformer, base_model: Transformer) -> None:
    out = Engine(model, "bf16").generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert all(len(r) == 4 for r in out.responses)
    assert next(iter(Engine(copy.deepcopy(base_model), "bf16").model.parameters())).dtype == torch.bfloat16
    fp4 = Engine(copy.deepcopy(base_model), FP4Precision(compute_dtype="bf16"))
    out = fp4.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert all(len(r) == 4 and all(lp <= 0 for lp in lps) for r, lps in zip(out.responses, out.logprobs,
                                                                             strict=True))


def test_fused_router_samples_what_the_models_router_samples(model: Transformer, base_model: Transformer,
                                                             float64_router) -> None:
    """fused_norms hands every Router the backend's route_topk (kernels.route_topk on Triton; tests/kernels/
    test_router.py runs that engine): here the sim's, which is the router's own torch path, so greedy tokens,
    logprobs and routes come out bit for bit as without it. Every routing the engine does is also checked
    against a float64 router on the logits it was given, which does not share the model's code."""
    from trace_lightning import sim
    from trace_lightning.model.model import Router

    fused = Engine(model, "bf16", fused_norms=True)
    plain = Engine(copy.deepcopy(base_model), "bf16")
    routers = [m for m in fused.model.modules() if isinstance(m, Router)]
    assert all(m.fused is sim.route_topk for m in routers)
    assert all(m.fused is None for m in plain.model.modules() if isinstance(m, Router))
    calls = []

    def checked_route_topk(logits, top_k, scoring, normalize, out_dtype):  # noqa: ANN001, ANN202
        gates, ids = sim.route_topk(logits, top_k, scoring, normalize, out_dtype)
        float64_router(gates, ids, logits, top_k, scoring, normalize)
        calls.append(logits.shape)
        return gates, ids

    for router in routers:
        router.fused = checked_route_topk
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    a, b = fused.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert len(calls) >= len(routers) * params.max_new_tokens  # prefill and every decode step went through it
    assert a.responses == b.responses and a.logprobs == b.logprobs
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
