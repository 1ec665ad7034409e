"""A step's host record reaches the device micro-batch by micro-batch, each micro-batch's bytes those of its rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trace_lightning.guidance import BatchRecord, QuantRecord, collate_records
from trace_lightning.lit.batch import micro_batches
from trace_lightning.lit.prefetch import RecordPrefetch
from trace_lightning.quant import FP4Format


def _host_record(rows: int, pinned: bool) -> BatchRecord:
    g = torch.Generator().manual_seed(0)
    records = [QuantRecord.from_captures({(0, "attn_in"): FP4Format().quantize(torch.randn(n, 64, generator=g))},
                                         torch.zeros(1, n, 1, dtype=torch.long), 0, mode="parity")
               for n in range(3, 3 + rows)]
    record = collate_records(records)
    if not pinned:
        return record
    return dataclasses.replace(record, data=record.data.pin_memory(), routes=record.routes.pin_memory(),
                               valid=record.valid.pin_memory())


def _same(a: BatchRecord, b: BatchRecord) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in ((a.data, b.data), (a.routes, b.routes), (a.valid, b.valid)))


def test_off_a_gpu_each_micro_batch_is_its_rows_of_the_record() -> None:
    record = _host_record(5, pinned=False)
    parts = micro_batches(5, 2)
    prefetch = RecordPrefetch(record, parts, torch.device("cpu"))
    assert not prefetch.overlap
    for i, part in enumerate(parts):
        got = prefetch.get(i)
        assert got.data.data_ptr() == record.rows(part).data.data_ptr() and _same(got, record.rows(part))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pinned_host_record_is_copied_one_micro_batch_ahead_on_a_side_stream() -> None:
    record = _host_record(7, pinned=True)
    parts = micro_batches(7, 2)
    prefetch = RecordPrefetch(record, parts, torch.device("cuda"))
    assert prefetch.overlap
    for i, part in enumerate(parts):
        got = prefetch.get(i)
        assert got.data.is_cuda and set(prefetch._copies) == ({i + 1} if i + 1 < len(parts) else set())
        assert _same(got, record.rows(part))
