"""Layer policies on worked examples, and their errors."""

from __future__ import annotations

import pytest

from trace_lightning.guidance import (
    Compaction,
    layer_bytes_per_token,
    parse_layer_policy,
    rank_layers_by_mismatch,
    select_layers,
)
from trace_lightning.model import MoEConfig


def test_all_none_last_deep() -> None:
    assert select_layers("all", 8, 10.0) == list(range(8))
    assert select_layers("none", 8, 10.0) == []
    assert select_layers("last:1", 8, 10.0) == [7]
    assert select_layers("last:3", 8, 10.0) == [5, 6, 7]
    assert select_layers("last:20", 8, 10.0) == list(range(8))
    assert select_layers("deep:0.5", 8, 10.0) == [4, 5, 6, 7]
    assert select_layers("deep:0.3", 8, 10.0) == [5, 6, 7]  # 2.4 layers rounds up
    assert select_layers("deep:0", 8, 10.0) == []
    assert select_layers("deep:1", 8, 10.0) == list(range(8))


def test_boundary_layers_are_never_candidates() -> None:
    quantized = list(range(1, 7))  # bf16 first and last layer
    assert select_layers("all", 8, 10.0, quantized=quantized) == quantized
    assert select_layers("deep:0.5", 8, 10.0, quantized=quantized) == [4, 5, 6]
    assert select_layers("last:1", 8, 10.0, quantized=quantized) == [6]
    costs = layer_bytes_per_token(MoEConfig.from_name("debug-moe", n_layers=8, bf16_first_layers=1,
                                                      bf16_last_layers=1), "nvfp4", "parity")
    assert sorted(costs) == quantized and select_layers("deep:0.5", 8, costs) == [4, 5, 6]


def test_budget_picks_the_deepest_layers_that_fit() -> None:
    assert select_layers("budget:250", 8, 100.0) == [6, 7]
    assert select_layers("budget:300", 8, 100.0) == [5, 6, 7]
    assert select_layers("budget:99", 8, 100.0) == []
    costs = {0: 10.0, 1: 10.0, 2: 50.0, 3: 30.0}
    assert select_layers("budget:45", 4, costs) == [3]  # layer 2 does not fit next: stop (deepest contiguous)
    assert select_layers("budget:90", 4, costs) == [1, 2, 3]
    assert select_layers("budget:250", 8, 100.0, overhead=60.0) == [7]
    config = MoEConfig.from_name("debug-moe")
    parity = layer_bytes_per_token(config, "nvfp4", "parity")
    assert parity == {layer: 156.0 for layer in range(4)}
    assert select_layers("budget:400", 4, parity) == [2, 3]
    assert Compaction("parity", "budget:400").layers_for(config, "nvfp4") == [2, 3]
    assert Compaction("full", "budget:400").layers_for(config, "nvfp4") == [3]


def test_auto_ranks_layers_by_measured_mismatch() -> None:
    agreement = {0: 0.99, 1: 0.90, 2: 0.999, 3: 1.0, 4: 0.90}
    assert rank_layers_by_mismatch(agreement) == [4, 1, 0, 2, 3]  # ties: deeper first
    assert select_layers("auto", 5, 100.0, agreement) == [0, 1, 2, 4]  # layer 3 agrees fully
    assert select_layers("auto:200", 5, 100.0, agreement) == [1, 4]
    assert select_layers("auto:300", 5, 100.0, agreement) == [0, 1, 4]
    assert select_layers("auto:300", 5, 100.0, agreement, quantized=[0, 2, 3]) == [0, 2, 3]
    with pytest.raises(ValueError, match="'auto' needs a code-agreement audit"):
        select_layers("auto", 5, 100.0)


@pytest.mark.parametrize("text", ["", "deep", "deep:x", "deep:1.5", "last:1.5", "last:-1", "foo", "all:3",
                                  "budget:-1", "budget:inf", "deep:nan", "none:"])
def test_bad_policy_strings_name_themselves(text: str) -> None:
    with pytest.raises(ValueError, match=f"bad layer policy {text!r}"):
        parse_layer_policy(text)
    with pytest.raises(ValueError, match="bad layer policy"):
        select_layers(text, 8, 1.0)


def test_parse_and_compaction_validation() -> None:
    p = parse_layer_policy("budget:512")
    assert (p.kind, p.value, p.text) == ("budget", 512.0, "budget:512")
    assert parse_layer_policy(p) is p
    with pytest.raises(ValueError, match="unknown guidance mode 'half'"):
        Compaction("half", "all")
    with pytest.raises(ValueError, match="bad layer policy 'deep:2'"):
        Compaction("parity", "deep:2")
    with pytest.raises(ValueError, match=r"layers \[9\] are not layers of an 8-layer model"):
        select_layers("all", 8, {9: 1.0})
