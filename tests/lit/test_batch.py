"""The TrainBatch helpers place ragged rows in one tensor op each, as a row-by-row loop places them."""

from __future__ import annotations

import random

import torch

from trace_lightning.lit.batch import pad_sequences, place, response_targets


def test_ragged_rows_land_where_a_row_loop_puts_them() -> None:
    rng = random.Random(0)
    rows = [[rng.randrange(100) for _ in range(rng.randrange(0, 9))] for _ in range(40)] + [[]]
    starts = [rng.randrange(0, 5) for _ in rows]
    width = max(s + len(r) for s, r in zip(starts, rows, strict=True)) + 2
    expected = torch.full((len(rows), width), -1.0)
    for i, (s, r) in enumerate(zip(starts, rows, strict=True)):
        expected[i, s : s + len(r)] = torch.tensor(r, dtype=torch.float32)
    assert torch.equal(place(rows, starts, width, -1.0, torch.float32), expected)

    seqs = [r + [7] for r in rows]  # none empty
    tokens, mask = pad_sequences(seqs, pad_id=0)
    assert tokens.dtype == torch.long and tokens.shape == (len(seqs), max(map(len, seqs)))
    for i, s in enumerate(seqs):
        assert tokens[i, : len(s)].tolist() == s and not tokens[i, len(s) :].any()
        assert mask[i].tolist() == [j < len(s) for j in range(tokens.shape[1])]

    prompt_lens = [rng.randrange(1, 4) for _ in seqs]
    totals = [p + len(s) for p, s in zip(prompt_lens, seqs, strict=True)]
    targets = response_targets(prompt_lens, totals, max(totals))
    for i, (p, t) in enumerate(zip(prompt_lens, totals, strict=True)):
        assert targets[i].tolist() == [p - 1 <= j < t - 1 for j in range(max(totals) - 1)]
