"""A record's strided views (the training window, a micro-batch's rows) go to the device by asynchronous copies of
pinned memory, and arrive bit for bit (torch's own copy gathers such a view into pageable memory first)."""

from __future__ import annotations

import pytest
import torch

from trace_lightning.guidance.record import _strided_to, view_to


def _record_bytes() -> torch.Tensor:
    return torch.randint(0, 256, (8, 40, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_rows_of_a_window_travel_as_the_span_they_cover_and_keep_their_view() -> None:
    window = _record_bytes()[:, :33]
    rows = window[2:5]
    moved = _strided_to(rows, "cpu")
    assert moved.stride() == rows.stride()  # the span path: the same view of the copied span
    assert torch.equal(moved, rows)


def test_a_thin_slice_across_a_large_tensor_is_gathered_first() -> None:
    routes = torch.randint(0, 64, (4, 8, 40, 3), dtype=torch.uint8)[:, :, :33]  # (layers, B, T, k), windowed
    rows = routes[:, 2:4]  # a micro-batch's rows of every layer: 1/4 of the span between its first and last byte
    moved = _strided_to(rows, "cpu")
    assert moved.is_contiguous() and torch.equal(moved, rows)


def test_unpinned_and_contiguous_tensors_take_torchs_copy() -> None:
    t = _record_bytes()[:, :33]
    assert view_to(t, "cpu") is t.to("cpu")  # same device, no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_pinned_views_arrive_on_the_gpu_bit_for_bit() -> None:
    data = _record_bytes().pin_memory()
    routes = torch.randint(0, 64, (4, 8, 40, 3), dtype=torch.uint8).pin_memory()
    for view in (data[:, :33][2:5], routes[:, :, :33][:, 2:4], data[3:4, :1]):
        assert view.is_pinned()
        moved = view_to(view, "cuda")
        torch.cuda.synchronize()
        assert moved.device.type == "cuda" and torch.equal(moved.cpu(), view)
