"""The CUDA-graph decode: replayed steps give the eager loop's tokens, logprobs and records.

A captured step attends over the whole cache window (the mask hides what is not yet written), where the eager
loop attends over the visible prefix; steps 1-2 run eagerly, then one capture and replays until every row is done.
The CPU checks both with the capture emulated (a "graph" whose replay runs the step); the GPU test captures for
real. Logprobs are not bit-identical between the two: the full window's softmax sums in another order.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from trace_lightning.guidance import BatchRecord
from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams
from trace_lightning.rollout.decode import DecodeLoop

from .conftest import PROMPTS

PARAMS = SamplingParams(max_new_tokens=[7, 3, 8, 6], temperature=1.0, seed=4)


def emulated_capture(loop: DecodeLoop) -> None:
    """What _capture sets up, on the CPU: the full cache window, and a replay that runs the captured step."""
    loop.use_graph = False
    loop.cache.visible = loop.cache.max_len
    loop.graph = types.SimpleNamespace(replay=loop.step)


def emulate_graphs(monkeypatch: pytest.MonkeyPatch,
                   capture: Callable[[DecodeLoop], None] = emulated_capture) -> None:
    """From here on, decode loops capture and replay as on a GPU, through `capture` (CPU emulation)."""
    init = DecodeLoop.__init__

    def graph_on_cpu(self: DecodeLoop, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        init(self, *args, **kwargs)
        self.use_graph = True

    monkeypatch.setattr(DecodeLoop, "__init__", graph_on_cpu)
    monkeypatch.setattr(DecodeLoop, "_capture", capture)


def assert_same_rollout(a: RolloutBatch, b: RolloutBatch) -> None:
    """Same tokens, routes and record bytes; logprobs to float32 rounding. Attending over the whole window sums
    the softmax over more (masked, zero) terms in another blocking, which moves a logprob by an ulp or two
    (measured on the CPU: at most 2.4e-7 on values near -2.4, i.e. 2 ulps; allowed 4) but, here, no token or FP4
    code."""
    assert a.responses == b.responses
    for ours, theirs in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2.0**-21, atol=0)
    assert all(torch.equal(x, y) for x, y in zip(a.routes, b.routes, strict=True))
    for ours, theirs in zip(a.captures or [], b.captures or [], strict=True):
        assert ours.keys() == theirs.keys()
        for key, q in ours.items():
            assert torch.equal(q.packed, theirs[key].packed), key
            assert torch.equal(q.scale_bytes(), theirs[key].scale_bytes()), key


def test_replayed_steps_over_the_full_window_equal_the_eager_loop(model: Transformer, base_model: Transformer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    eager = Engine(copy.deepcopy(base_model), FP4Precision(compute_dtype="fp32"), backend="sim", cuda_graph=False)
    want = eager.generate(PROMPTS, PARAMS, capture=CaptureSpec())
    assert want.stats["graph_steps"] == 0 and want.stats["capture_s"] == 0.0
    emulate_graphs(monkeypatch)
    got = Engine(model, FP4Precision(compute_dtype="fp32"), backend="sim", cuda_graph=False).generate(
        PROMPTS, PARAMS, capture=CaptureSpec())
    # Steps 1 and 2 eager, then replays through step 7 (the longest response has 8 tokens) unless all stop early.
    assert 0 < got.stats["graph_steps"] <= max(PARAMS.max_new_tokens) - 3
    assert got.stats["decode_steps"] == want.stats["decode_steps"]
    assert_same_rollout(got, want)


def test_no_capture_for_short_generations(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture pays off only with replays after it: none when fewer than two steps would follow step 3."""
    captured = []
    emulate_graphs(monkeypatch, lambda loop: captured.append(1) or emulated_capture(loop))
    out = Engine(model, "fp32", cuda_graph=False).generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert not captured and out.stats["graph_steps"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", FP4Precision(compute_dtype="bf16")])
def test_cuda_graph_decode_equals_eager_decode(base_model: Transformer, precision: object) -> None:
    """The real capture on CUDA: tokens, logprobs, routes and record bytes as the eager loop's, sampling included."""
    model = copy.deepcopy(base_model).to("cuda")  # the fixture is shared by the module
    capture = CaptureSpec() if isinstance(precision, FP4Precision) else None
    eager = Engine(copy.deepcopy(model), precision, cuda_graph=False).generate(PROMPTS, PARAMS, capture=capture)
    graph = Engine(copy.deepcopy(model), precision, cuda_graph=True).generate(PROMPTS, PARAMS, capture=capture)
    assert graph.stats["graph_steps"] > 0 and eager.stats["graph_steps"] == 0
    assert graph.stats["capture_s"] > 0.0 and eager.stats["capture_s"] == 0.0
    assert_same_rollout(graph, eager)  # the CPU's 4-ulp logprob allowance: not yet measured on a GPU


@pytest.mark.gpu
def test_cuda_graph_captures_stop_tokens_held_back(base_model: Transformer) -> None:
    """min_new_tokens inside the captured step (a host copy there makes the capture fall back to eager steps)."""
    model = copy.deepcopy(base_model).to("cuda")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=[1, 2], min_new_tokens=10)
    eager = Engine(copy.deepcopy(model), "bf16", cuda_graph=False).generate(PROMPTS, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns
        graph = Engine(copy.deepcopy(model), "bf16", cuda_graph=True).generate(PROMPTS, params)
    assert graph.stats["graph_steps"] > 0
    assert_same_rollout(graph, eager)


@pytest.mark.parametrize("stream", [False, True], ids=["on-device", "streamed"])
def test_replayed_steps_write_the_eager_loops_parity_record(base_model: Transformer, monkeypatch: pytest.MonkeyPatch,
                                                            stream: bool) -> None:
    """The record written from a replayed step (ring columns from the device step counter when streamed) is the
    eager loop's, byte for byte; CPU emulation of the capture."""
    params = SamplingParams(max_new_tokens=[17, 3, 12, 9], temperature=1.0, seed=6)
    capture, precision = CaptureSpec(mode="parity", stream_to_host=stream), FP4Precision(compute_dtype="fp32")
    # fp32: the replay attends over the whole window, and in bf16 that moves a sum by an ulp (then a code, a token)
    eager = Engine(copy.deepcopy(base_model), precision, cuda_graph=False, sync_every=3).generate(
        PROMPTS, params, capture=capture)
    emulate_graphs(monkeypatch)
    graph = Engine(copy.deepcopy(base_model), precision, cuda_graph=False, sync_every=3).generate(
        PROMPTS, params, capture=capture)
    assert graph.stats["graph_steps"] > 0 and graph.responses == eager.responses
    assert_same_record(graph.record, eager.record)


def assert_same_record(a: BatchRecord, b: BatchRecord) -> None:
    """Block scales and parity bits byte for byte; fp32 row globals to the ulp or two that attending over the whole
    window (the replay) instead of the grown one (eager) moves a sum by (measured: globals only, no scale, no bit)."""
    assert a.layout == b.layout and torch.equal(a.valid.cpu(), b.valid.cpu())
    ours, theirs = a.layout.views(a.data.cpu()), b.layout.views(b.data.cpu())
    for key, (scales, payload, g) in ours.items():
        assert torch.equal(scales, theirs[key][0]) and torch.equal(payload, theirs[key][1]), key
        if g is not None:
            torch.testing.assert_close(g, theirs[key][2], rtol=2.0**-20, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("stream", [False, True], ids=["on-device", "streamed"])
def test_cuda_graph_parity_record_equals_eager(base_model: Transformer, stream: bool) -> None:
    """The real capture on CUDA with the Triton record-slot kernel, the record kept on the device or streamed."""
    model = copy.deepcopy(base_model).to("cuda")
    capture = CaptureSpec(mode="parity", stream_to_host=stream)
    precision = FP4Precision(compute_dtype="bf16")
    eager = Engine(copy.deepcopy(model), precision, cuda_graph=False).generate(PROMPTS, PARAMS, capture=capture)
    graph = Engine(copy.deepcopy(model), precision, cuda_graph=True).generate(PROMPTS, PARAMS, capture=capture)
    assert graph.stats["graph_steps"] > 0 and graph.responses == eager.responses
    assert graph.record.data.device.type == ("cpu" if stream else "cuda")
    assert_same_record(graph.record, eager.record)


# ---- a kept decode session: later calls of the same shape replay from their first step ------------------------
def weight_pointers(engine: Engine) -> dict[str, list[int]]:
    """Where every tensor a forward reads lives: the FP4 weights' fields and the dense parameters."""
    pointers = {name: [t.data_ptr()] for name, t in engine._dense.items()}
    for name, (module, key) in engine._fp4_weights.items():
        q = module.q[key] if isinstance(module.q, dict) else module.q
        pointers[name] = [t.data_ptr() for f in dataclasses.fields(q) if isinstance(t := getattr(q, f.name), Tensor)]
    return pointers


def keep_sessions(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """Emulated graphs (as on a GPU) whose replays fail if a weight moved since the capture (a real graph would read
    the old address), and engines keeping their decode sessions as on a GPU."""

    def pinned_capture(loop: DecodeLoop) -> None:
        emulated_capture(loop)
        pinned = weight_pointers(engine)

        def replay() -> None:
            assert weight_pointers(engine) == pinned, "a weight moved under the captured graph"
            loop.step()

        loop.graph = types.SimpleNamespace(replay=replay)

    emulate_graphs(monkeypatch, pinned_capture)
    monkeypatch.setattr(Engine, "_keeps_decode_graphs", lambda self: self.keep_decode_graph)


FP32 = FP4Precision(compute_dtype="fp32")  # fp32: a whole-window replay and a grown-window eager step agree on codes


def test_a_kept_session_replays_every_step_of_later_calls_across_weight_syncs(
        base_model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second call of a shape replays all its decode steps on the first call's buffers and graph, and gives what
    a fresh engine gives; a weight sync writes in place (the graph sees the new weights, nothing moved); the first
    call's record, handed over as a copy, is untouched; records and routes have the call's length, not the kept
    cache's."""
    capture = CaptureSpec()
    kept = Engine(copy.deepcopy(base_model), FP32, cuda_graph=False, sync_every=3)
    keep_sessions(monkeypatch, kept)
    first = kept.generate(PROMPTS, SamplingParams(max_new_tokens=[9, 3, 12, 7], temperature=1.0, seed=1), capture)
    session, record = kept._session, first.record.data.clone()
    assert session is not None and first.stats["graph_steps"] > 0
    length = max(len(p) + m for p, m in zip(PROMPTS, [9, 3, 12, 7], strict=True))
    assert first.record.data.shape[1] == first.route_table.shape[2] == length < session.recorder.max_len

    prompts = [[1, 2, 3], [1, 8, 9, 10, 11], [1, 4], [1, 60, 61, 62, 63, 64, 65]]  # other lengths, same bucket
    params = SamplingParams(max_new_tokens=[12, 5, 10, 2], temperature=1.0, seed=2)

    def fresh(model: Transformer) -> RolloutBatch:
        return Engine(copy.deepcopy(model), FP32, cuda_graph=False, sync_every=3).generate(prompts, params, capture)

    second = kept.generate(prompts, params, capture)
    assert kept._session is session and second.stats["graph_steps"] == second.stats["decode_steps"] - 1
    assert_same_rollout(second, fresh(base_model))
    assert_same_record(second.record, fresh(base_model).record)
    assert torch.equal(first.record.data, record)

    torch.manual_seed(9)
    other = Transformer(base_model.config).eval()
    kept.update_weights({k: v.detach().clone() for k, v in other.state_dict().items()}, version=1)
    assert kept._session is session
    third = kept.generate(prompts, params, capture)
    assert third.stats["graph_steps"] == third.stats["decode_steps"] - 1
    assert_same_rollout(third, fresh(other))
    assert third.responses != second.responses


def test_another_shape_or_no_keeping_builds_a_new_session(base_model: Transformer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(copy.deepcopy(base_model), FP32, cuda_graph=False)
    keep_sessions(monkeypatch, engine)
    engine.generate(PROMPTS, PARAMS)
    session = engine._session
    smaller = engine.generate(PROMPTS[:2], PARAMS.__class__(max_new_tokens=7, temperature=1.0, seed=4))
    assert engine._session is not None and engine._session is not session
    assert smaller.stats["graph_steps"] < smaller.stats["decode_steps"] - 1  # eager steps, then a capture
    greedy = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=7, temperature=0.0))  # sampling is baked in
    assert greedy.stats["graph_steps"] < greedy.stats["decode_steps"] - 1
    engine.release_decode_session()
    assert engine._session is None
    unkept = Engine(copy.deepcopy(base_model), FP32, cuda_graph=False, keep_decode_graph=False)
    unkept.generate(PROMPTS, PARAMS)
    assert unkept._session is None


def test_a_one_off_call_leaves_the_kept_session_to_the_next_call(base_model: Transformer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit-like call (another record layout) builds and frees its own session: the kept one stays, and the next
    call replays every step on it; a one-off call of the kept shape uses it. Each gives what a fresh engine gives."""
    rollout, audit = CaptureSpec(layers={1}), CaptureSpec()  # one layer recorded, and every layer
    engine = Engine(copy.deepcopy(base_model), FP32, cuda_graph=False)
    keep_sessions(monkeypatch, engine)
    engine.generate(PROMPTS, PARAMS, rollout)
    session = engine._session
    assert session is not None

    def fresh(capture: CaptureSpec) -> RolloutBatch:
        return Engine(copy.deepcopy(base_model), FP32, cuda_graph=False).generate(PROMPTS, PARAMS, capture)

    once = engine.generate(PROMPTS, PARAMS, audit, one_off=True)
    assert engine._session is session and once.stats["graph_steps"] < once.stats["decode_steps"] - 1
    assert_same_rollout(once, fresh(audit))
    assert_same_record(once.record, fresh(audit).record)
    for one_off in (False, True):
        again = engine.generate(PROMPTS, PARAMS, rollout, one_off=one_off)
        assert engine._session is session and again.stats["graph_steps"] == again.stats["decode_steps"] - 1
        assert_same_rollout(again, fresh(rollout))
        assert_same_record(again.record, fresh(rollout).record)


@pytest.mark.gpu
def test_cuda_graph_kept_across_calls_and_a_weight_sync_equals_eager(base_model: Transformer) -> None:
    """The real thing on CUDA: the second call (after a weight sync) replays the first call's graph and samples
    what an eager engine with the new weights samples."""
    model = copy.deepcopy(base_model).to("cuda")
    precision, capture = FP4Precision(compute_dtype="bf16"), CaptureSpec(mode="parity")
    kept = Engine(copy.deepcopy(model), precision, cuda_graph=True)
    kept.generate(PROMPTS, PARAMS, capture=capture)
    torch.manual_seed(9)
    other = Transformer(base_model.config).eval().to("cuda")
    kept.update_weights({k: v.detach().clone() for k, v in other.state_dict().items()}, version=1)
    again = kept.generate(PROMPTS, PARAMS, capture=capture)
    eager = Engine(copy.deepcopy(other), precision, cuda_graph=False).generate(PROMPTS, PARAMS, capture=capture)
    assert again.stats["capture_s"] == 0.0 and again.stats["graph_steps"] == again.stats["decode_steps"] - 1
    assert again.responses == eager.responses
    assert_same_record(again.record, eager.record)


@pytest.mark.slow  # the Triton engine under the interpreter: CI runs it in its slow pass
def test_triton_kept_session_syncs_word_layout_weights_in_place(base_model: Transformer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton engine holding its weights as on CUDA (the kernels' word layout, tiles where the shape allows):
    a weight sync writes the new words into the held tensors (the emulated replays check nothing moved), and the
    kept session's next call gives what a fresh engine with those weights gives. CPU, under the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA: test_cuda_graph_kept_across_calls_and_a_weight_sync_equals_eager")
    from trace_lightning.kernels import layout
    from trace_lightning.quant.words import WordNVFP4

    monkeypatch.setattr(layout, "prefers_word_layout", lambda dtype, device, cache=False: True)
    params = SamplingParams(max_new_tokens=[5, 3, 6], temperature=1.0, seed=4)  # a capture at step 3, 2 replays
    kept = Engine(copy.deepcopy(base_model), FP32, backend="triton", cuda_graph=False)
    held = [m.q[k] if isinstance(m.q, dict) else m.q for m, k in kept._fp4_weights.values()]
    assert all(isinstance(q, WordNVFP4) for q in held) and {q.tiled for q in held} == {True, False}
    keep_sessions(monkeypatch, kept)
    kept.generate(PROMPTS[:3], params, capture=CaptureSpec())
    torch.manual_seed(9)
    other = Transformer(base_model.config).eval()
    kept.update_weights({k: v.detach().clone() for k, v in other.state_dict().items()}, version=1)
    again = kept.generate(PROMPTS[:3], params, capture=CaptureSpec())
    assert again.stats["graph_steps"] == again.stats["decode_steps"] - 1
    fresh = Engine(copy.deepcopy(other), FP32, backend="triton", cuda_graph=False)
    assert kept.weight_checksums() == fresh.weight_checksums()
    assert_same_rollout(again, fresh.generate(PROMPTS[:3], params, capture=CaptureSpec()))
