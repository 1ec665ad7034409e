"""Prefill equals decode, bit for bit: the logits the exact engine decodes token by token are those of one forward
over the whole sequence (the training step's), whatever the batch, a row's place in it, the prompt lengths, or
continuous batching (rtol=0, atol=0). On the CPU and, where one is present, on a CUDA device; with the FP4 steps on
torch's ops (backend sim / auto) and on the exact Triton kernels (backend triton: under Triton's interpreter on the
CPU), while the training forward here always runs torch's: the two agree bit for bit."""

import copy

import pytest
import torch

from trace_lightning.exact import ExactForward
from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.rollout import Engine, FP4Precision, SamplingParams


@pytest.fixture(scope="module")
def master() -> Transformer:
    torch.manual_seed(0)
    return Transformer(MoEConfig.from_name("debug-moe", n_layers=2))


DEVICES = [("cpu", "sim"), ("cpu", "triton"), ("cuda", "auto"), ("cuda", "triton")]
"""(device, engine backend): "auto" is what a fit takes by default (torch's exact ops), "triton" the exact Triton
kernels (under Triton's interpreter on the CPU)."""


def _case(where: tuple[str, str], *rest: object) -> object:
    name = "-".join([*where, *(str(r).removeprefix("torch.") for r in rest)])
    return pytest.param(where, *rest, marks=[pytest.mark.gpu] if where[0] == "cuda" else [], id=name)


def _engine(master: Transformer, dtype: torch.dtype, where: tuple[str, str] = ("cpu", "sim")) -> Engine:
    """The exact engine on `where`'s device with its backend."""
    device, backend = where
    return Engine(copy.deepcopy(master).to(device), FP4Precision(compute_dtype=dtype), backend=backend, exact=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in torch.randint(1, 10, (n,), generator=g)]


def _decoded_logits(engine: Engine, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Each sequence's logits at positions len(prompt)-1 .. len(seq)-2: a prefill, then one decode step a token."""
    recorder, hook, cache = engine._call_buffers(None, len(seqs), max(map(len, seqs)))
    prompts = [s[:n] for s, n in zip(seqs, prompt_lens, strict=True)]
    out = [[row] for row in engine.prefill(prompts, cache, hook, recorder)]
    dev = engine.device
    pos = torch.tensor(prompt_lens, device=dev)
    for _ in range(max(len(s) - n for s, n in zip(seqs, prompt_lens, strict=True)) - 1):
        pos = torch.minimum(pos, torch.tensor([len(s) - 1 for s in seqs], device=dev))  # a finished row repeats
        cache.visible = int(pos.max()) + 1
        tokens = torch.tensor([s[p] for s, p in zip(seqs, pos.tolist(), strict=True)], device=dev)[:, None]
        logits = engine.decode_one_token(tokens, pos[:, None], cache, hook, recorder)
        for b, row in enumerate(logits):
            if len(out[b]) < len(seqs[b]) - prompt_lens[b]:
                out[b].append(row)
        pos = pos + 1
    return [torch.stack(rows) for rows in out]


def _full_logits(master: Transformer, dtype: torch.dtype, seqs: list[list[int]], device: str = "cpu") -> torch.Tensor:
    """One forward of the trainer's master weights over the right-padded sequences: (B, T, V)."""
    T = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), T, dtype=torch.long), torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), True
    with torch.no_grad():
        forward = ExactForward(copy.deepcopy(master).to(device), dtype)
        return forward(ids.to(device), attention_mask=mask.to(device)).logits


INTERPRETED = ("cpu", "triton")
"""Under Triton's interpreter a test takes ~30 s: one case of each test runs there."""
DECODE_CASES = [_case(where, dtype, batch) for where in DEVICES for dtype in (torch.float32, torch.bfloat16)
                for batch in (1, 5) if where != INTERPRETED or (dtype, batch) == (torch.bfloat16, 5)]


@pytest.mark.parametrize(("where", "dtype", "batch"), DECODE_CASES)
def test_decoded_logits_equal_the_full_forwards(master: Transformer, dtype: torch.dtype, batch: int,
                                                where: tuple[str, str]) -> None:
    engine, device = _engine(master, dtype, where), where[0]
    prompts = _prompts(batch, seed=batch)
    g = torch.Generator().manual_seed(10 + batch)
    seqs = [p + torch.randint(1, 128, (4,), generator=g).tolist() for p in prompts]
    decoded = _decoded_logits(engine, seqs, [len(p) for p in prompts])
    full = _full_logits(master, dtype, seqs, device)
    for b, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        assert torch.equal(decoded[b], full[b, len(p) - 1 : len(s) - 1]), f"row {b}"
    # the same sequence alone, and at another place in another batch: the same bits
    alone = _decoded_logits(engine, seqs[-1:], [len(prompts[-1])])[0]
    assert torch.equal(alone, decoded[-1])
    others = _prompts(3, seed=99)
    mixed = [others[0] + [5, 6], seqs[-1], others[1] + [7]]
    moved = _decoded_logits(engine, mixed, [len(others[0]), len(prompts[-1]), len(others[1])])[1]
    assert torch.equal(moved, decoded[-1])


SAMPLE_CASES = [_case(where, max_batch) for where in DEVICES for max_batch in (None, 2)
                if where != INTERPRETED or max_batch == 2]


@pytest.mark.parametrize(("where", "max_batch"), SAMPLE_CASES)
def test_sampled_logprobs_equal_the_training_forwards(master: Transformer, max_batch: int | None,
                                                      where: tuple[str, str]) -> None:
    """generate (static or continuous batching) against the training forward: every response token's logprob."""
    engine, device = _engine(master, torch.float32, where), where[0]
    prompts = _prompts(6, seed=7)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=7, temperature=1.0, seed=3), max_batch=max_batch)
    seqs = [p + r for p, r in zip(prompts, out.responses, strict=True)]
    logprobs = _full_logits(master, torch.float32, seqs, device).float().log_softmax(-1).cpu()
    for b, (p, r) in enumerate(zip(prompts, out.responses, strict=True)):
        want = logprobs[b, len(p) - 1 : len(p) - 1 + len(r)].gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.equal(torch.tensor(out.logprobs[b]), want), f"sequence {b}"


@pytest.mark.parametrize("where", [_case(where) for where in DEVICES if where != INTERPRETED])
def test_continuous_batching_samples_the_static_batchs_tokens(master: Transformer, where: tuple[str, str]) -> None:
    """Batch-invariant logits make the batching invisible: two slots refilled as sequences finish sample the tokens
    and logprobs of one static batch (on a GPU the plain bf16 engine's tokens changed with the batching for 426 of 512
    sequences). On CUDA for the torch path and the exact Triton kernels."""
    engine = _engine(master, torch.bfloat16, where)
    prompts = _prompts(6, seed=11)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=5)
    static, continuous = (engine.generate(prompts, params, max_batch=m) for m in (None, 2))
    assert continuous.responses == static.responses
    assert continuous.logprobs == static.logprobs


def test_exact_engine_refuses_what_it_cannot_compute(master: Transformer) -> None:
    with pytest.raises(ValueError, match="NVFP4 weights, activations and KV cache"):
        Engine(copy.deepcopy(master), FP4Precision(fmt="mxfp4"), backend="sim", exact=True)
    with pytest.raises(ValueError, match="NVFP4 weights, activations and KV cache"):
        Engine(copy.deepcopy(master), "bf16", backend="sim", exact=True)
