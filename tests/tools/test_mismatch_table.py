"""tools/mismatch_table.py end to end on a tiny setting: the JSON rows and the orderings the tool exists to show."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "mismatch_table.py"
KEYS = {"method", "k3_kl", "logprob_abs_diff", "code_agreement", "route_agreement", "bytes_per_token"}


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mismatch_table", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("table") / "rows.json"
    threads = torch.get_num_threads()
    try:
        returned = _tool().main(["--preset", "debug-moe", "--steps", "1", "--prompts", "4", "--max-new-tokens", "6",
                                 "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    return {r["method"]: r for r in written}


def test_json_rows_cover_every_method_with_the_keys(rows: dict[str, dict]) -> None:
    assert {"bf16", "fp4_naive", "fp4_qat", "trace", "trace_compact", "fp4_qat+route_replay",
            "trace_compact+route_replay"} <= set(rows)
    for row in rows.values():
        assert KEYS <= set(row), row["method"]


def test_trace_replays_every_recorded_code_and_beats_plain_qat(rows: dict[str, dict]) -> None:
    trace, qat = rows["trace"], rows["fp4_qat"]
    assert trace["code_agreement"] == trace["value_agreement"] == 1.0
    assert set(trace["layer_code_agreement"].values()) == {1.0}
    assert trace["own_code_agreement"] < 1.0  # a bf16 rollout does round differently from fp32 training
    assert qat["code_agreement"] < 1.0
    assert trace["k3_kl"] <= qat["k3_kl"]


def test_route_replay_and_record_sizes(rows: dict[str, dict]) -> None:
    for name in ("fp4_qat+route_replay", "trace_compact+route_replay"):
        assert rows[name]["route_agreement"] == 1.0
    assert rows["fp4_qat"]["bytes_per_token"] == rows["bf16"]["bytes_per_token"] == 0.0
    assert rows["fp4_qat+route_replay"]["bytes_per_token"] == 8.0  # 4 layers x top-2 uint8 expert ids
    assert rows["trace_compact"]["bytes_per_token"] <= 0.5 * rows["trace"]["bytes_per_token"]
