"""Continuous batching (generate(..., max_batch=k), rollout/slots.py): a sequence comes out the same whatever
slot count decoded it, as in a static batch and as alone, and refills keep the slots busy.

Tokens, routes and the FP4 records' codes and block scales are compared bit for bit. The float values,
logprobs and the NVFP4 records' fp32 row global scales (amax / (6 * 448) of the activation), are
bit-identical with one slot (the sequence then runs exactly as alone: same shapes everywhere); with other
batch compositions they move by a few ulps, as they already do between a static batch and a prompt alone,
because the CPU's matmuls sum in a blocking that depends on the number of rows (measured here: logprobs at
most 1.5e-6 apart, allowed 1e-5 as in test_engine's ragged-batch test; global scales at most 1.5e-6
relative, allowed 1e-5).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams, sequence_seeds

from .test_decode_graph import assert_same_rollout, emulate_graphs, keep_sessions

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 40, 41], [1, 70, 71], [2, 3], [1, 2, 3, 4, 5, 6], [9, 9, 9]]
MAX_NEW = [9, 3, 12, 1, 6, 15, 4]
SEED = 11


def assert_same_sequence(a: RolloutBatch, i: int, b: RolloutBatch, j: int, exact: bool = False) -> None:
    """Sequence i of a and sequence j of b: same tokens, finish reason, routes and FP4 codes and block scales;
    the float values (logprobs, NVFP4 row global scales) bit-identical when `exact`, else to the float32
    rounding of the batch composition (see the module docstring)."""
    assert a.responses[i] == b.responses[j] and a.finish_reasons[i] == b.finish_reasons[j]
    atol = 0.0 if exact else 1e-5
    torch.testing.assert_close(torch.tensor(a.logprobs[i]), torch.tensor(b.logprobs[j]), rtol=0, atol=atol)
    assert torch.equal(a.routes[i], b.routes[j])
    assert (a.captures is None) == (b.captures is None)
    for key, q in (a.captures[i] if a.captures is not None else {}).items():
        theirs = b.captures[j][key]  # type: ignore[index]
        assert torch.equal(q.packed, theirs.packed), key
        assert torch.equal(q.scale_bytes(), theirs.scale_bytes()), key
        if hasattr(q, "global_scale"):  # NVFP4's fp32 row scale: amax / (6 * 448) of the activation itself
            torch.testing.assert_close(q.global_scale, theirs.global_scale, rtol=0 if exact else 1e-5, atol=0)


@pytest.mark.parametrize(
    ("precision", "capture"),
    [("fp32", None), (FP4Precision(compute_dtype="fp32"), CaptureSpec(layers="all", mode="full"))],
    ids=["fp32", "nvfp4-capture"],
)
def test_every_slot_count_gives_the_static_batch_and_each_sequence_alone(
    model: Transformer, precision: FP4Precision | str, capture: CaptureSpec | None
) -> None:
    engine = Engine(model, precision, sync_every=3)
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, seed=SEED))
    stop = [free.responses[0][1], free.responses[5][3]]  # sequences 0 and 5 (at least) end early
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED, stop_token_ids=stop)
    static = engine.generate(PROMPTS, params, capture=capture)
    assert "stop" in static.finish_reasons and "length" in static.finish_reasons
    seeds = sequence_seeds(SEED, len(PROMPTS))
    alone = [
        engine.generate([p], SamplingParams(max_new_tokens=m, seed=[s], stop_token_ids=stop), capture=capture)
        for p, m, s in zip(PROMPTS, MAX_NEW, seeds, strict=True)
    ]
    for slots in (1, 2, 3):
        out = engine.generate(PROMPTS, params, capture=capture, max_batch=slots)
        assert out.stats["refills"] == len(PROMPTS) - slots
        for i in range(len(PROMPTS)):
            assert_same_sequence(out, i, static, i)
            assert_same_sequence(out, i, alone[i], 0, exact=slots == 1)


def test_mxfp4_records_through_refills(model: Transformer) -> None:
    """The MXFP4 cache keeps its rows in position-indexed RowBuffers: refills copy those too."""
    engine = Engine(model, FP4Precision(fmt="mxfp4", compute_dtype="fp32"), sync_every=2)
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    static = engine.generate(PROMPTS, params, capture=CaptureSpec())
    out = engine.generate(PROMPTS, params, capture=CaptureSpec(), max_batch=2)
    for i in range(len(PROMPTS)):
        assert_same_sequence(out, i, static, i)


def test_refills_copy_the_gpu_cache_layouts(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused attention on the packed cache with the GPU's layouts (codes in words, values in tiles), which the sim
    writes and reads too: a refill's copy of whole rows keeps them, and attention reads them as written."""
    import trace_lightning.sim as sim

    monkeypatch.setattr(sim, "prefers_word_layout", lambda *args, **kwargs: True)
    monkeypatch.setattr(sim, "prefers_value_tiles", lambda *args, **kwargs: True)
    engine = Engine(model, FP4Precision(compute_dtype="fp32"), fused_attention=True, sync_every=2)
    layers = engine._cache(2, 16, None).layers.values()  # type: ignore[attr-defined]
    assert all(layer.words and layer.value_tiles for layer in layers)
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    static = engine.generate(PROMPTS, params, capture=CaptureSpec())
    out = engine.generate(PROMPTS, params, capture=CaptureSpec(), max_batch=2)
    for i in range(len(PROMPTS)):
        assert_same_sequence(out, i, static, i)


def test_refills_keep_a_long_tailed_mix_in_fewer_steps(model: Transformer) -> None:
    """One long and many short sequences in 2 slots: the long one holds a slot while the other slot runs through
    the short ones, where static batches of 2 wait for their slowest row each time."""
    engine = Engine(model, "fp32", sync_every=2)
    max_new = [24, 2, 3, 2, 4, 3, 2, 3]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(max_new))]
    seeds = sequence_seeds(SEED, len(prompts))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, seed=seeds), max_batch=2)
    assert out.stats["refills"] == len(prompts) - 2
    assert out.stats["new_tokens"] == sum(max_new)
    static_steps = 0.0
    for start in range(0, len(prompts), 2):
        chunk = engine.generate(
            prompts[start : start + 2],
            SamplingParams(max_new_tokens=max_new[start : start + 2], seed=seeds[start : start + 2]),
        )
        static_steps += chunk.stats["decode_steps"]
        for j in range(len(chunk)):
            assert_same_sequence(out, start + j, chunk, j)
    assert out.stats["decode_steps"] < static_steps


def test_max_batch_at_least_the_prompts_is_the_static_batch(model: Transformer) -> None:
    engine = Engine(model, "fp32")
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    static = engine.generate(PROMPTS, params)
    for max_batch in (len(PROMPTS), 100):
        out = engine.generate(PROMPTS, params, max_batch=max_batch)
        assert out.stats["refills"] == 0
        for i in range(len(PROMPTS)):
            assert_same_sequence(out, i, static, i, exact=True)


@pytest.mark.parametrize("max_batch", [0, -2, 1.5, True, "2"])
def test_bad_max_batch(model: Transformer, max_batch: object) -> None:
    with pytest.raises(ValueError, match="max_batch must be None or an integer >= 1"):
        Engine(model, "fp32").generate(PROMPTS, SamplingParams(max_new_tokens=2), max_batch=max_batch)  # type: ignore[arg-type]


def test_refills_between_graph_replays(
    model: Transformer, base_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot step captured once (emulated on the CPU, as in test_decode_graph) and replayed across refills:
    a refill only writes, in place, into buffers the captured step reads."""
    precision, params = FP4Precision(compute_dtype="fp32"), SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    eager = Engine(copy.deepcopy(base_model), precision, cuda_graph=False, sync_every=2)
    want = eager.generate(PROMPTS, params, capture=CaptureSpec(), max_batch=3)
    emulate_graphs(monkeypatch)
    got = Engine(model, precision, cuda_graph=False, sync_every=2).generate(
        PROMPTS, params, capture=CaptureSpec(), max_batch=3
    )
    assert got.stats["graph_steps"] > 0 and got.stats["refills"] == want.stats["refills"] == len(PROMPTS) - 3
    assert got.stats["decode_steps"] == want.stats["decode_steps"]
    assert_same_rollout(got, want)


def test_a_kept_slot_session_serves_the_next_call_across_a_weight_sync(
    model: Transformer, base_model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continuous batching keeps its decode session too (emulated graphs whose replays check no weight moved): the
    next call, after a weight sync, loads its prompts into the same slot buffers, replays the slot step captured by
    the first call across its refills, and gives what a fresh engine with the new weights gives."""
    precision, params = FP4Precision(compute_dtype="fp32"), SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    kept = Engine(model, precision, cuda_graph=False, sync_every=2)
    keep_sessions(monkeypatch, kept)
    kept.generate(PROMPTS, params, capture=CaptureSpec(), max_batch=3)
    session = kept._session
    torch.manual_seed(9)
    other = Transformer(base_model.config).eval()
    kept.update_weights({k: v.detach().clone() for k, v in other.state_dict().items()}, version=1)
    again_params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED + 1)
    again = kept.generate(PROMPTS, again_params, capture=CaptureSpec(), max_batch=3)
    assert kept._session is session and session is not None
    assert again.stats["graph_steps"] == again.stats["decode_steps"] - 1 and again.stats["refills"] == len(PROMPTS) - 3
    want = Engine(copy.deepcopy(other), precision, cuda_graph=False, sync_every=2).generate(
        PROMPTS, again_params, capture=CaptureSpec(), max_batch=3
    )
    assert again.stats["decode_steps"] == want.stats["decode_steps"]
    assert_same_rollout(again, want)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", FP4Precision(compute_dtype="bf16")], ids=["bf16", "nvfp4-bf16"])
def test_cuda_graph_slots_equal_eager_slots(base_model: Transformer, precision: FP4Precision | str) -> None:
    """The real capture on CUDA (Triton kernels, fused attention on the packed cache, value tiles): the slot step
    replayed across refills gives the eager slot loop's tokens, routes and record bytes."""
    model = copy.deepcopy(base_model).to("cuda")  # the fixture is shared by the module
    capture = CaptureSpec() if isinstance(precision, FP4Precision) else None
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    runs = {
        graph: Engine(copy.deepcopy(model), precision, cuda_graph=graph, sync_every=2).generate(
            PROMPTS, params, capture=capture, max_batch=3
        )
        for graph in (False, True)
    }
    assert runs[True].stats["graph_steps"] > 0 and runs[True].stats["refills"] == len(PROMPTS) - 3
    assert_same_rollout(runs[True], runs[False])


def test_min_new_tokens_holds_back_stops_in_static_and_continuous_batches(model: Transformer) -> None:
    engine = Engine(model, "fp32")
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=15, temperature=0.0)).responses
    stop = first[0][1]  # a token greedy decoding picks early
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=SEED, stop_token_ids=[stop])
    free = engine.generate(PROMPTS, params)
    assert any(r == "stop" and len(x) <= 4 for r, x in zip(free.finish_reasons, free.responses, strict=True))
    held = dataclasses.replace(params, min_new_tokens=5)
    static = engine.generate(PROMPTS, held)
    for response, budget in zip(static.responses, MAX_NEW, strict=True):
        assert len(response) >= min(6, budget) and stop not in response[:5]
    for slots in (1, 3):
        sloted = engine.generate(PROMPTS, held, max_batch=slots)
        for i in range(len(PROMPTS)):
            assert_same_sequence(static, i, sloted, i)
