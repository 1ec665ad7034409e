"""Chunked prefill (Engine(prefill_chunk=C)): prompts prefilled C positions a forward, each chunk attending to the
cache the earlier chunks wrote, give the sequences one forward gives.

Tokens, finish reasons, routes and the FP4 records' codes and block scales are compared bit for bit; logprobs and
NVFP4 row globals to the float32 rounding of another batch shape (the CPU's matmuls block by the number of rows, as
between a static batch and a prompt alone: tests/rollout/test_continuous.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams

from .test_continuous import MAX_NEW, PROMPTS, SEED, assert_same_sequence


@pytest.mark.parametrize(
    ("precision", "capture"),
    [
        ("fp32", None),
        ("bf16", None),
        (FP4Precision(compute_dtype="fp32"), CaptureSpec(layers="all", mode="full")),
        (FP4Precision(compute_dtype="bf16"), CaptureSpec(layers="all", mode="parity")),
        (FP4Precision(compute_dtype="bf16"), CaptureSpec(layers="all", mode="parity", stream_to_host=True)),
    ],
    ids=["fp32", "bf16", "nvfp4-full", "nvfp4-bf16-parity", "nvfp4-bf16-parity-streamed"],
)
def test_chunked_prefill_gives_the_one_forward_sequences(base_model: Transformer, precision: FP4Precision | str,
                                                         capture: CaptureSpec | None) -> None:
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    whole = Engine(copy.deepcopy(base_model), precision).generate(PROMPTS, params, capture=capture)
    for chunk in (1, 2, 4):  # the longest prompt has 9 tokens: 9, 5 and 3 forwards
        out = Engine(copy.deepcopy(base_model), precision, prefill_chunk=chunk).generate(PROMPTS, params,
                                                                                         capture=capture)
        if capture is not None and capture.mode == "parity":  # parity records hold no codes to read back: bytes
            assert out.record is not None and whole.record is not None
            assert torch.equal(out.record.valid, whole.record.valid)
            assert torch.equal(out.record.data[out.record.valid], whole.record.data[whole.record.valid])
            assert out.responses == whole.responses and torch.equal(out.record.routes, whole.record.routes)
            for ours, theirs in zip(out.logprobs, whole.logprobs, strict=True):
                torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
            continue
        for i in range(len(PROMPTS)):
            assert_same_sequence(out, i, whole, i)


def test_chunked_prefill_with_continuous_batching(base_model: Transformer) -> None:
    """Refills prefill through the same path: chunks and slots together still give the static batch."""
    precision, capture = FP4Precision(compute_dtype="fp32"), CaptureSpec(layers="all", mode="full")
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=SEED)
    static = Engine(copy.deepcopy(base_model), precision).generate(PROMPTS, params, capture=capture)
    out = Engine(copy.deepcopy(base_model), precision, prefill_chunk=3).generate(PROMPTS, params, capture=capture,
                                                                                 max_batch=2)
    for i in range(len(PROMPTS)):
        assert_same_sequence(out, i, static, i)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "8"])
def test_prefill_chunk_must_be_a_positive_integer(base_model: Transformer, bad: object) -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be None or an integer >= 1"):
        Engine(copy.deepcopy(base_model), "fp32", prefill_chunk=bad)  # type: ignore[arg-type]
