"""Sequences whose KV cache stays live between forwards, each extended by the tokens its caller gives it.

Multi-turn rollouts (rollout/turns.py) sample a turn, hand it to an environment, and then continue the same
sequence with the environment's reply: forced tokens that go through one prefill-like forward of just those tokens
at the row's next positions, attending to the cache the row already has, so the conversation is never prefilled
again. A sampled token is fed the same way, one token at a time: a decode step is a feed of one token a row.

Every forward covers every row (the model writes cache rows by batch index). A row fed fewer tokens than the widest
row, or none, is padded with token 0 at its next positions: keys, values, records and routes written there are
garbage, but no query reads them (a query at position p attends to keys 0..p only) and the row's next real token
overwrites them before any query of the row reaches that position, exactly as a right-padded prefill's padding is
(rollout/cache.py). A row's positions 0 .. length - 1 therefore hold what one forward over its whole sequence would
have computed there, up to the reduction order of batched GEMMs (tests/rollout/test_turns.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from trace_lightning.guidance.record import BatchRecord
from trace_lightning.rollout.batch import CaptureSpec

if TYPE_CHECKING:
    from trace_lightning.rollout.engine import Engine


class LiveBatch:
    """`rows` sequences of up to `max_len` positions in one KV cache and record; `feed` extends them."""

    def __init__(self, engine: Engine, rows: int, max_len: int, capture: CaptureSpec | None = None) -> None:
        if rows < 1 or max_len < 2:
            raise ValueError(f"a live batch needs rows >= 1 and max_len >= 2, got {rows}, {max_len}")
        if capture is not None and capture.stream_to_host:
            raise ValueError("a live batch keeps its record on the device: capture.stream_to_host is not supported")
        self.engine, self.rows, self.max_len, self.capture = engine, rows, max_len, capture
        self.recorder, self.hook, self.cache = engine._call_buffers(capture, rows, max_len)
        self.recorder.begin(max_len)
        self.lengths = [0] * rows
        """Positions each row has fed through the model (its cache holds keys 0 .. length - 1)."""

    @torch.inference_mode()
    def feed(self, tokens: list[list[int]]) -> Tensor:
        """Append tokens[r] to row r (empty: the row waits) in one forward -> logits (rows, V) after each row's last
        new token (rows fed nothing: meaningless values)."""
        if len(tokens) != self.rows:
            raise ValueError(f"feed needs one token list per row ({self.rows}), got {len(tokens)}")
        width = max(1, max(len(t) for t in tokens))
        end = max(n + width for n in self.lengths)
        if end > self.max_len:
            raise ValueError(f"feeding {width} tokens a row needs {end} positions; the live batch holds {self.max_len}")
        vocab = self.engine.config.vocab_size
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        for r, row in enumerate(tokens):
            if row and not all(type(t) is int and 0 <= t < vocab for t in row):
                raise ValueError(f"row {r}: tokens {row!r:.60} are not ids in [0, {vocab})")
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        dev = self.engine.device
        positions = (torch.tensor(self.lengths)[:, None] + torch.arange(width)).to(dev)
        last = torch.tensor([max(len(t) - 1, 0) for t in tokens], device=dev)
        self.cache.visible = end
        self.recorder.rows = self.recorder.step = None
        logits = self.engine._forward(ids.to(dev), positions, self.cache, self.hook, self.recorder, logits_at=last)
        self.lengths = [n + len(t) for n, t in zip(self.lengths, tokens, strict=True)]
        return logits[:, 0]

    def route_table(self, lengths: list[int]) -> Tensor:
        """[L, rows, max_len, top_k] expert ids of positions 0 .. lengths[r] - 1 (filler past them), as training
        reads them (normal tensors, not inference ones)."""
        with torch.inference_mode(False):
            return self.recorder.route_table(torch.tensor(lengths, device=self.engine.device))

    def batch_record(self, lengths: list[int], routes: Tensor) -> BatchRecord | None:
        """The FP4 record of positions 0 .. lengths[r] - 1 of every row (None without capture)."""
        if self.capture is None:
            return None
        with torch.inference_mode(False):
            return self.recorder.batch_record(torch.tensor(lengths, device=self.engine.device), routes,
                                              self.engine.policy_version, self.engine.model_id)
