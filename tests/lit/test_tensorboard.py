"""TensorBoard shows what was measured, when it was measured: no re-logged values, no constant Lightning tags."""

import math

from trace_lightning.lit.tensorboard import agreement_heatmap, discrepancy_layout, tensorboard_tags


def test_ratios_near_one_are_drawn_as_their_distance_from_one() -> None:
    tags = tensorboard_tags({"mismatch/ess": 0.75, "mismatch/is_ratio_max": 1.5, "mismatch/is_ratio_min": 0.25,
                             "mismatch_bf16/token_mult_prob_error": 1.125, "mismatch/k3_kl": 0.5,
                             "reward/mean": math.nan, "agreement/own_codes": 0.875})
    assert tags == {"mismatch/one_minus_ess": 0.25, "mismatch/is_ratio_max_minus_one": 0.5,
                    "mismatch/one_minus_is_ratio_min": 0.75, "mismatch_bf16/token_mult_prob_error_minus_one": 0.125,
                    "mismatch/k3_kl": 0.5, "agreement/own_codes": 0.875}


def test_layout_charts_every_site_and_the_mismatch_metrics() -> None:
    layout = discrepancy_layout(["attn_in", "moe_down"])
    charts = {title: spec for category in layout.values() for title, spec in category.items()}
    assert all(kind == "Multiline" for kind, _ in charts.values())
    k3 = next(tags for title, (_, tags) in charts.items() if title.startswith("k3_kl"))
    assert k3 == ["mismatch/k3_kl$"]  # the BF16 reference is a sub-run under the same tag (RunLogger)
    per_site = [title for title in charts if title.startswith(("attn_in:", "moe_down:"))]
    assert len(per_site) == 2


def test_heatmap_puts_layers_on_rows_and_sites_in_layer_order() -> None:
    own = {(1, "moe_in"): 0.97, (0, "attn_in"): 0.99, (0, "moe_in"): 0.98, (1, "attn_in"): 0.96}
    fig = agreement_heatmap(own, {key: 1.0 for key in own}, step=10)
    left = fig.axes[0]
    assert [t.get_text() for t in left.get_xticklabels()] == ["attn_in", "moe_in"]
    assert [t.get_text() for t in left.get_yticklabels()] == ["layer 0", "layer 1"]
    assert sorted(t.get_text() for t in left.texts) == ["96.00", "97.00", "98.00", "99.00"]
