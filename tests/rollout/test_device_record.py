"""The engine's record is one packed tensor on its device, written in the capture's mode while decoding: recording
parity bits directly gives exactly the bytes of recording full codes and compacting them afterwards."""

from __future__ import annotations

import copy

import pytest
import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams
from trace_lightning.rollout.capture import ring_runs

from .conftest import PROMPTS

PARAMS = SamplingParams(max_new_tokens=[5, 3, 6, 4], temperature=1.0, seed=4, stop_token_ids=[7])


@pytest.mark.parametrize("precision", [FP4Precision(compute_dtype="fp32"), FP4Precision(),
                                       FP4Precision(fmt="mxfp4", mx_mode="rceil")], ids=["fp32", "bf16", "mxfp4"])
def test_recording_parity_equals_compacting_full_codes(base_model: Transformer, precision: FP4Precision) -> None:
    layers = {1}
    full = Engine(copy.deepcopy(base_model), precision).generate(PROMPTS, PARAMS, capture=CaptureSpec())
    parity = Engine(copy.deepcopy(base_model), precision).generate(PROMPTS, PARAMS,
                                                                   capture=CaptureSpec(layers=layers, mode="parity"))
    assert parity.responses == full.responses and parity.logprobs == full.logprobs  # recording changes nothing
    expected = full.record.compact("parity", layers=layers)
    assert parity.record.layout == expected.layout and parity.record.mode == "parity"
    assert torch.equal(parity.record.data, expected.data) and torch.equal(parity.record.valid, expected.valid)
    assert torch.equal(parity.route_table, full.route_table)
    assert parity.record.layout.width * 3 < full.record.layout.width  # one layer's parity bits, not all codes


def test_the_record_is_one_tensor_on_the_engine_device(base_model: Transformer) -> None:
    out = Engine(copy.deepcopy(base_model), FP4Precision()).generate(PROMPTS, PARAMS, capture=CaptureSpec())
    record, S = out.record, max(len(p) + m for p, m in zip(PROMPTS, PARAMS.max_new_tokens, strict=True))
    assert record.data.shape == (len(PROMPTS), S, record.layout.width) and record.data.is_contiguous()
    assert record.routes.dtype == out.route_table.dtype == torch.uint8  # 8 experts: one byte per id
    assert record.valid.sum(1).tolist() == [out.record_length(b) for b in range(len(PROMPTS))]
    assert record.policy_versions == [0] * len(PROMPTS) and record.model_id == Engine(
        copy.deepcopy(base_model), FP4Precision()).model_id
    record.check(expected_version=0)  # every scale a quantizer wrote, pad rows included, and distinct experts
    for b in range(len(PROMPTS)):  # the per-sequence views agree with the batch tensor
        n = out.record_length(b)
        assert torch.equal(out.routes[b], out.route_table[:, b, :n].long())
        for (layer, site), q in out.captures[b].items():
            assert torch.equal(q.packed, record.ref(layer, site).packed[b, :n])


def test_parity_records_hold_no_codes_to_read_back(base_model: Transformer) -> None:
    out = Engine(copy.deepcopy(base_model), FP4Precision()).generate(PROMPTS, PARAMS,
                                                                     capture=CaptureSpec(mode="parity"))
    with pytest.raises(ValueError, match="parity records keep no codes"):
        _ = out.captures
    sequence = out.record.sequence(2)  # but each sequence's compact record can still be cut out (to save or send)
    assert sequence.mode == "parity" and sequence.length == out.record_length(2)


def test_the_memory_plan_counts_the_capture_mode(base_model: Transformer) -> None:
    engine = Engine(copy.deepcopy(base_model), FP4Precision())
    full, parity = (engine.memory_plan(8, 64, CaptureSpec(mode=m)).records for m in ("full", "parity"))
    assert 0 < parity < full / 2


@pytest.mark.parametrize("max_batch", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("mode", ["full", "parity"])
def test_a_record_streamed_to_the_host_is_the_same_bytes(base_model: Transformer, mode: str,
                                                         max_batch: int | None) -> None:
    """A ring of max(prompt, check interval) columns, flushed at every host check, many times over a long response."""
    params = SamplingParams(max_new_tokens=[13, 3, 17, 9], temperature=1.0, seed=5, stop_token_ids=[7])
    kept, streamed = (Engine(copy.deepcopy(base_model), FP4Precision(), sync_every=2).generate(
        PROMPTS, params, capture=CaptureSpec(mode=mode, stream_to_host=host), max_batch=max_batch)
        for host in (False, True))
    assert streamed.responses == kept.responses and streamed.record.data.device.type == "cpu"
    assert torch.equal(streamed.record.data, kept.record.data.cpu()) and streamed.record.layout == kept.record.layout
    assert torch.equal(streamed.record.valid, kept.record.valid.cpu())
    assert torch.equal(streamed.record.routes, kept.record.routes.cpu())
    streamed.record.check(expected_version=0)


def test_the_streaming_ring_is_bounded_by_prompt_and_check_interval(base_model: Transformer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring holds the longest prompt or RING_CHECKS checks' decode steps; flushed only when the next check's
    steps might not fit, so most host checks copy nothing."""
    from trace_lightning.rollout import capture as capture_module
    from trace_lightning.rollout.engine import RING_CHECKS

    rings: list[tuple[int, ...]] = []
    copied: list[int] = []
    init, flush = capture_module.Recorder.__init__, capture_module.Recorder._flush

    def spy(self: capture_module.Recorder, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        rings.append(tuple(self.ring.shape) if self.ring is not None else ())

    def counted(self: capture_module.Recorder, positions: torch.Tensor) -> None:
        copied.append(int((positions >= 0).sum(1).max()))
        flush(self, positions)

    monkeypatch.setattr(capture_module.Recorder, "__init__", spy)
    monkeypatch.setattr(capture_module.Recorder, "_flush", counted)
    engine = Engine(copy.deepcopy(base_model), FP4Precision(), sync_every=4)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40), capture=CaptureSpec(stream_to_host=True))
    width = out.record.layout.width
    assert RING_CHECKS == 4 and rings == [(len(PROMPTS), 16, width)]  # 4 checks of 4 steps (the prompts: <= 9)
    assert out.record.data.shape == (len(PROMPTS), max(len(p) for p in PROMPTS) + 40, width)
    # the prompt's columns after the prefill; then 39 decode steps with 9 host checks (before steps 4, 8, .., 36):
    # a flush only where 4 more steps might not fit in 16 columns (before step 16: 15 written; before 32: 16), and
    # the last 8 at the end: 3 flushes of decode columns where every check flushed before
    assert copied == [9, 15, 16, 8]


def test_dense_prefill_computes_what_the_fp4_kernels_do(base_model: Transformer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_dense_from: the prefill (36 token rows here) runs dense GEMMs on the dequantized weights, the decode
    steps (4 rows) the FP4 kernels; same tokens, logprobs to fp32 rounding, the records' codes the same."""
    from trace_lightning.rollout.convert import FP4Experts

    precision = FP4Precision(compute_dtype="fp32")
    kernels = Engine(copy.deepcopy(base_model), precision).generate(PROMPTS, PARAMS, capture=CaptureSpec())
    dense_rows: list[int] = []
    forward_dense = FP4Experts._forward_dense

    def spy(self: FP4Experts, x: torch.Tensor, *args: object) -> torch.Tensor:
        dense_rows.append(x.shape[0] * x.shape[1])
        return forward_dense(self, x, *args)

    monkeypatch.setattr(FP4Experts, "_forward_dense", spy)
    dense = Engine(copy.deepcopy(base_model), precision, prefill_dense_from=16).generate(PROMPTS, PARAMS,
                                                                                         capture=CaptureSpec())
    assert dense_rows == [len(PROMPTS) * max(len(p) for p in PROMPTS)] * 2  # the prefill, in each layer; no step
    assert dense.responses == kernels.responses
    for a, b in zip(dense.logprobs, kernels.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    codes = [(q.codes(), kernels.captures[b][key].codes()) for b in range(len(PROMPTS))
             for key, q in dense.captures[b].items()]
    flipped = sum(int((x != y).sum()) for x, y in codes)
    assert flipped <= 2, flipped  # an fp32 sum in another order can cross a rounding boundary, very rarely
    with pytest.raises(ValueError, match="prefill_dense_from must be None or an integer >= 1"):
        Engine(copy.deepcopy(base_model), precision, prefill_dense_from=0)


def test_ring_runs_split_where_positions_or_rows_break() -> None:
    """Runs of consecutive positions of one output row: a wrapped ring (positions 10, 11 in columns 3, 4 after 12, 13
    in 0, 1), an unused column, a slot that changed sequence mid-ring, and an empty forward row."""
    positions = torch.tensor([[12, 13, -1, 10, 11], [5, 6, 7, 0, 1], [-1, -1, -1, -1, -1]])
    rows = torch.tensor([[0, 0, 0, 0, 0], [2, 2, 2, 3, 3], [1, 1, 1, 1, 1]])
    assert ring_runs(positions, rows) == [(0, 0, 0, 12, 2), (0, 3, 0, 10, 2), (1, 0, 2, 5, 3), (1, 3, 3, 0, 2)]
