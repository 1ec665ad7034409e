"""TensorBoard shows what was measured, when it was measured: no re-logged values, no constant Lightning tags,
near-1 fractions as their distance from 1, and every compared series a run of its own colour."""

import math
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_lightning.lit.tensorboard import (
    EVAL_TEXT_TAG,
    RunLogger,
    agreement_heatmap,
    discrepancy_layout,
    tensorboard_tags,
)


def test_ratios_and_agreements_near_one_are_drawn_as_their_distance_from_one() -> None:
    tags = tensorboard_tags({"mismatch/ess": 0.75, "mismatch/is_ratio_max": 1.5, "mismatch/is_ratio_min": 0.25,
                             "mismatch_bf16/token_mult_prob_error": 1.125, "mismatch/k3_kl": 0.5,
                             "reward/mean": math.nan, "agreement/own_codes": 0.875, "moe/route_agreement": 0.75,
                             "agreement_per_layer/used_values/layer3/k": 0.5, "eval/accuracy": 0.875})
    assert tags == {"mismatch/one_minus_ess": 0.25, "mismatch/is_ratio_max_minus_one": 0.5,
                    "mismatch/one_minus_is_ratio_min": 0.75, "mismatch_bf16/token_mult_prob_error_minus_one": 0.125,
                    "mismatch/k3_kl": 0.5, "agreement/one_minus_own_codes": 0.125,
                    "moe/one_minus_route_agreement": 0.25, "agreement_per_layer/one_minus_used_values/layer3/k": 0.5,
                    "eval/accuracy": 0.875}
    assert tensorboard_tags({"agreement/used_values": 1 - 4e-6})["agreement/one_minus_used_values"] > 3.9e-6


def test_layout_has_one_tag_per_chart_and_charts_every_site() -> None:
    layout = discrepancy_layout(["attn_in", "moe_down"])
    charts = {title: spec for category in layout.values() for title, spec in category.items()}
    assert all(kind == "Multiline" and len(tags) == 1 for kind, tags in charts.values())  # lines differ by run
    k3 = next(tags for title, (_, tags) in charts.items() if title.startswith("k3_kl"))
    assert k3 == ["^mismatch/k3_kl$"]  # the BF16 reference is a sub-run under the same tag (RunLogger)
    per_site = [tags[0] for title, (_, tags) in charts.items() if title.startswith(("attn_in:", "moe_down:"))]
    assert sorted(per_site) == ["^agreement_per_layer/one_minus_own_codes/attn_in$",
                                "^agreement_per_layer/one_minus_own_codes/moe_down$",
                                "^agreement_per_layer/one_minus_used_values/attn_in$",
                                "^agreement_per_layer/one_minus_used_values/moe_down$"]
    assert any(tags == ["^eval/accuracy$"] for _, tags in charts.values())


def _events(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_run_logger_writes_references_and_layers_as_sub_runs_and_evals_as_a_table(tmp_path: Path) -> None:
    logger = RunLogger(str(tmp_path), "run")
    logger.log_metrics({"mismatch/k3_kl": 1e-5, "mismatch_bf16/k3_kl": 2e-5,
                        "agreement_per_layer/one_minus_used_values/layer2/k": 4e-6}, step=3)
    logger.log_metrics({"eval/accuracy": 0.828, "eval/bf16_accuracy": 0.859}, step=4)
    logger.log_metrics({"eval/accuracy": 0.5}, step=8)
    logger.finalize("success")
    run = tmp_path / "run" / "version_0"
    main, reference, layer = _events(run), _events(run / "bf16_reference"), _events(run / "layer_02")
    assert {e.step: round(e.value, 6) for e in main.Scalars("eval/accuracy")} == {4: 0.828, 8: 0.5}
    assert [(e.step, round(e.value, 3)) for e in reference.Scalars("eval/accuracy")] == [(4, 0.859)]
    assert [(e.step, round(e.value, 9)) for e in reference.Scalars("mismatch/k3_kl")] == [(3, 2e-5)]
    assert layer.Tags()["scalars"] == ["agreement_per_layer/one_minus_used_values/k"]
    assert not any(t.startswith("agreement_per_layer") for t in main.Tags()["scalars"])
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in main.Tensors(EVAL_TEXT_TAG + "/text_summary")}
    assert tables[4].splitlines()[0] == "| step | eval/accuracy | eval/bf16_accuracy |"
    assert tables[4].splitlines()[-1] == "| 4 | 0.8280 | 0.8590 |" and tables[8].splitlines()[-1] == "| 8 | 0.5000 |"


def test_heatmap_shows_disagreement_with_layers_on_rows_and_sites_in_layer_order() -> None:
    own = {(1, "moe_in"): 0.97, (0, "attn_in"): 1 - 4e-6, (0, "moe_in"): 1.0, (1, "attn_in"): 0.5}
    fig = agreement_heatmap(own, {key: 1.0 for key in own}, step=10)
    left = fig.axes[0]
    assert [t.get_text() for t in left.get_xticklabels()] == ["attn_in", "moe_in"]
    assert [t.get_text() for t in left.get_yticklabels()] == ["L0", "L1"]
    assert sorted(t.get_text() for t in left.texts) == ["0", "3e-2", "4e-6", "5e-1"]
    assert sorted(t.get_text() for t in fig.axes[1].texts) == ["0", "0", "0", "0"]  # used values: all equal
    width, height = fig.get_size_inches() * fig.dpi
    assert 300 <= width <= 400 and height <= 1600  # TensorBoard's image card width
