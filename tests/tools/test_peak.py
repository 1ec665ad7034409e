"""tools/_peak.py: the allocator trace replayed to its peak names what was live there."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import _peak  # noqa: E402


def _alloc(addr: int, size: int, line: int) -> dict:
    frames = [{"filename": "/x/trace_lightning/rollout/capture.py", "line": line, "name": "f"},
              {"filename": "/x/tools/bench.py", "line": 1, "name": "main"}]
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def test_the_peak_and_what_is_live_there() -> None:
    events = [
        {"action": "free_requested", "addr": 99, "size": 1 << 30, "frames": []},  # allocated before the trace
        _alloc(1, 100, 10), _alloc(2, 300, 20),
        {"action": "free_requested", "addr": 1, "size": 100}, {"action": "free_completed", "addr": 1, "size": 100},
        _alloc(3, 250, 20),  # peak: 2 and 3 (550)
        {"action": "free_completed", "addr": 2, "size": 300},
        _alloc(4, 400, 30),  # 3 and 4: 650, the new peak
        {"action": "free_requested", "addr": 4, "size": 400},
        _alloc(5, 10, 40),
    ]
    peak, blocks = _peak.live_at_peak(events)
    assert peak == 650 and sorted(blocks) == [3, 4]
    assert _peak.grouped(blocks) == [(400, 1, "capture.py:30 f"), (250, 1, "capture.py:20 f")]
    _, before = _peak.live_at_peak(events[:6])
    assert sorted(before) == [2, 3] and _peak.grouped(before) == [(550, 2, "capture.py:20 f")]


@pytest.mark.gpu
def test_peak_blocks_sees_a_transient_tensor_on_cuda() -> None:
    device = torch.device("cuda")

    def fn() -> None:
        held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        del held
        torch.empty(1 << 20, dtype=torch.uint8, device=device)

    peak, sites = _peak.peak_blocks(fn, device)
    assert peak >= 64 << 20 and sites[0][0] >= 64 << 20 and "test_peak.py" in sites[0][2]
