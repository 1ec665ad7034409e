"""TensorBoard that shows the train-rollout discrepancy at a glance.

Lightning writes every value ever logged in an epoch again at each logging step, and an RL run is one
endless epoch, so a value measured once (an audit, the warm start's loss) would be drawn as if measured at
every later step. Training metrics therefore go to TensorBoard through `log_measured`, at the step they were
measured and only then; Lightning's own path keeps them for the progress bar and callbacks (`logger=False`).

Ratios that live near 1 (ess, is_ratio, token_mult_prob_error) and the agreements (fractions of elements, of
routes equal to the rollout's) are drawn as their distance from 1, whose axis reads 4e-6 instead of "1 1 1 1",
so a change of a few elements in a million is a small bump, not a cliff. TensorBoard colours a chart's lines by
run, not by tag, so whatever a chart compares is a run of its own: the BF16 reference (``bf16_reference``) and
each layer (``layer_NN``) are sub-runs under the main run's tags. The custom-scalars layout then draws each
discrepancy next to its BF16 reference, FP4 eval accuracy next to the BF16 engine's, and one line per layer.
Eval accuracy, a handful of points that TensorBoard's default smoothing would pull far from the last value, is
also written as a table (TEXT tab). The heatmap shows layer x site disagreement at audit steps on a log scale.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

SITE_ORDER = ("attn_in", "k", "v", "attn_out", "moe_in", "moe_down", "shared_down")
"""Quantization sites in the order a layer runs them (model.hooks.SITES)."""

NEAR_ONE = {
    "ess": ("one_minus_ess", -1.0),
    "is_ratio_min": ("one_minus_is_ratio_min", -1.0),
    "is_ratio_mean": ("is_ratio_mean_minus_one", 1.0),
    "is_ratio_max": ("is_ratio_max_minus_one", 1.0),
    "token_mult_prob_error": ("token_mult_prob_error_minus_one", 1.0),
}
"""Ratios near 1 -> (TensorBoard tag, sign): the tag holds sign * (value - 1)."""


AGREEMENTS = re.compile(r"^(agreement|agreement_per_layer)/(\w+)(/.*)?$|^moe/(route_agreement)$")
"""Fractions near 1 drawn as 1 - value: agreement/X -> agreement/one_minus_X (and per layer, and routes)."""

REFERENCE_PREFIX = "mismatch_bf16/"
"""Metrics of the BF16 reference; RunLogger writes them as `mismatch/*` of a sub-run `bf16_reference`."""

REFERENCE_EVAL = {"eval/bf16_accuracy": "eval/accuracy"}
"""The BF16 engine's eval accuracy, also written to the bf16_reference sub-run as `eval/accuracy`."""

PER_LAYER = re.compile(r"^agreement_per_layer/(\w+)/layer(\d+)/(\w+)$")
"""agreement_per_layer/<kind>/layer<N>/<site>: written to sub-run layer_NN as agreement_per_layer/<kind>/<site>."""

EVAL_TEXT_TAG = "eval/accuracy_table"
UNSMOOTHED_URL_SUFFIX = "#custom_scalars&_smoothingWeight=0"
"""Appended to TensorBoard's address, opens the custom scalars with smoothing off (sparse series drawn as logged)."""


class RunLogger(TensorBoardLogger):
    """TensorBoard under save_dir/<name>/version_N without Lightning's `epoch` and `hp_metric` tags.

    `trace-rl` names the run after its method, task and model (runs/trace_compact-arithmetic-debug-moe/version_0,
    lit.runs), so one `tensorboard --logdir runs` overlays methods and tells runs apart. The BF16 reference
    (`mismatch_bf16/*`, and `eval/bf16_accuracy` as `eval/accuracy`) goes to the sub-run version_N/bf16_reference
    under the FP4 rollout's tags, and each layer's agreements to version_N/layer_NN, so every chart draws them
    beside the run, each in its own colour.
    """

    def __init__(self, save_dir: str = "runs", name: str | None = None, version: int | str | None = None,
                 **kwargs: Any) -> None:
        """
        Args:
            save_dir: Root folder of all runs.
            name: Sub-folder of this run; None: <method>-<task>-<model> (set by `trace-rl`).
            version: Sub-sub-folder; None: the next free version_N.
        """
        super().__init__(save_dir, name=name or "", version=version, default_hp_metric=False, **kwargs)
        self._subruns: dict[str, Any] = {}

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        reference = {"mismatch/" + k.removeprefix(REFERENCE_PREFIX): v for k, v in metrics.items()
                     if k.startswith(REFERENCE_PREFIX)}
        reference.update({REFERENCE_EVAL[k]: v for k, v in metrics.items() if k in REFERENCE_EVAL})
        layers: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            if match := PER_LAYER.match(key):
                kind, layer, site = match.groups()
                layers.setdefault(f"layer_{int(layer):02d}", {})[f"agreement_per_layer/{kind}/{site}"] = value
        own = {k: v for k, v in metrics.items() if k != "epoch" and not k.startswith(REFERENCE_PREFIX)
               and not PER_LAYER.match(k)}
        super().log_metrics(own, step)
        if not self._writes():
            return
        for run, scalars in ([("bf16_reference", reference)] if reference else []) + sorted(layers.items()):
            for tag, value in scalars.items():
                self.sub_writer(run).add_scalar(tag, value, step)
        if any(k.startswith("eval/") for k in own):
            self._log_eval_table(own, step)

    def _writes(self) -> bool:
        return self.experiment is not None and hasattr(self.experiment, "add_scalar")

    def _log_eval_table(self, metrics: Mapping[str, float], step: int | None) -> None:
        """This eval's values as a one-row markdown table at its step (TEXT tab lists every step's, newest first,
        across resumes too): exact values that no smoothing moves."""
        row = {k: v for k, v in sorted(metrics.items()) if k.startswith("eval/")}
        lines = ["| step | " + " | ".join(row) + " |", "|---" * (len(row) + 1) + "|",
                 f"| {step} | " + " | ".join(f"{v:.4f}" for v in row.values()) + " |"]
        self.experiment.add_text(EVAL_TEXT_TAG, "\n".join(lines), step)

    def sub_writer(self, run: str) -> Any:
        """The SummaryWriter of sub-run ``run`` (bf16_reference, layer_NN), made on first use."""
        if run not in self._subruns:
            self._subruns[run] = type(self.experiment)(log_dir=f"{self.log_dir}/{run}")
        return self._subruns[run]

    def reference_writer(self) -> Any:
        """The SummaryWriter of the bf16_reference sub-run."""
        return self.sub_writer("bf16_reference")

    def finalize(self, status: str) -> None:
        super().finalize(status)
        for writer in self._subruns.values():
            writer.close()


def tensorboard_tags(metrics: Mapping[str, float | Tensor]) -> dict[str, float]:
    """Floats under their TensorBoard tags (mismatch ratios and agreements near 1 as their distance from 1), NaNs
    left out."""
    out = {}
    for key, value in metrics.items():
        x = float(value)
        if math.isnan(x):
            continue
        family, _, name = key.partition("/")
        if family in ("mismatch", "mismatch_bf16") and name in NEAR_ONE:
            tag, sign = NEAR_ONE[name]
            out[f"{family}/{tag}"] = sign * (x - 1.0)
        elif match := AGREEMENTS.match(key):
            group, kind, rest, route = match.groups()
            out[f"moe/one_minus_{route}" if route else f"{group}/one_minus_{kind}{rest or ''}"] = 1.0 - x
        else:
            out[key] = x
    return out


def across_ranks(module: L.LightningModule, metrics: Mapping[str, float | Tensor],
                 sums: Iterable[str] = ()) -> dict[str, float | Tensor]:
    """Each metric over every data-parallel rank: the rank mean (each rank's share is scaled so that its mean is
    the global value, lit.parallel.loss_scale), or the sum for the keys in `sums`. One all-reduce per kind, not
    one per metric. One process: unchanged."""
    trainer = module.trainer
    if trainer.world_size <= 1:
        return dict(metrics)
    sums = set(sums)
    out: dict[str, float | Tensor] = {}
    for op in ("mean", "sum"):
        keys = [key for key in metrics if (key in sums) == (op == "sum")]
        if keys:
            stacked = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=module.device).reshape(())
                                   for k in keys])
            out.update(zip(keys, trainer.strategy.reduce(stacked, reduce_op=op).unbind(0), strict=True))
    return {key: out[key] for key in metrics}


def log_measured(module: L.LightningModule, metrics: Mapping[str, float | Tensor], step: int,
                 batch_size: int | None = None, every_step: bool = False, sums: Iterable[str] = ()) -> None:
    """Log metrics measured at training step `step` over all ranks (across_ranks): to the progress bar /
    callbacks, and to the loggers now (rank 0 writes).

    every_step=False follows the trainer's log_every_n_steps (cheap per-step metrics); True writes every call
    (audits and other measurements that do not happen every step).
    """
    if not metrics:
        return
    metrics = across_ranks(module, metrics, sums)
    for key, value in metrics.items():
        module.log(key, value, logger=False, batch_size=batch_size)
    trainer = module.trainer
    if not trainer.loggers or (not every_step and step % max(trainer.log_every_n_steps, 1)):
        return
    tags = tensorboard_tags(metrics)
    for logger in trainer.loggers:
        logger.log_metrics(tags, step)


def discrepancy_layout(sites: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout (TensorBoard's CUSTOM SCALARS tab): one chart per question, one tag per chart, so
    each line is a run (the run, its bf16_reference, its layer_NN sub-runs) in a colour of its own."""
    mismatch = {
        "k3_kl: FP4 rollout vs training (run) and BF16 rollout (run/bf16_reference)": "mismatch/k3_kl",
        "|logprob difference| per token (run; run/bf16_reference)": "mismatch/logprob_abs_diff",
        "token_mult_prob_error - 1 (run; run/bf16_reference)": "mismatch/token_mult_prob_error_minus_one",
        "1 - ess, effective sample size lost (run; run/bf16_reference)": "mismatch/one_minus_ess",
        "importance ratio max - 1": "mismatch/is_ratio_max_minus_one",
        "1 - importance ratio min": "mismatch/one_minus_is_ratio_min",
    }
    agreement = {
        "1 - agreement: values training used vs the rollout's, all sites": "agreement/one_minus_used_values",
        "1 - agreement: training's own codes vs the rollout's, all sites": "agreement/one_minus_own_codes",
        "1 - route agreement (top-k expert sets; only when routes are not replayed)": "moe/one_minus_route_agreement",
    }
    for kind, what in (("used_values", "values used"), ("own_codes", "own codes")):
        agreement.update({f"{site}: 1 - agreement of {what}, one line per layer (run/layer_NN)":
                          f"agreement_per_layer/one_minus_{kind}/{site}" for site in sites})
    learning = {
        "eval accuracy: FP4 engine (run) vs BF16 engine (run/bf16_reference); few points: set smoothing to 0 "
        f"({UNSMOOTHED_URL_SUFFIX}), exact values in TEXT {EVAL_TEXT_TAG}": "eval/accuracy",
        "reward": "reward/mean",
    }
    return {
        "1 train-rollout mismatch": {title: ["Multiline", [f"^{re.escape(tag)}$"]] for title, tag in mismatch.items()},
        "2 quantization disagreement (audit steps)": {title: ["Multiline", [f"^{re.escape(tag)}$"]]
                                                       for title, tag in agreement.items()},
        "3 learning": {title: ["Multiline", [f"^{re.escape(tag)}$"]] for title, tag in learning.items()},
    }


def write_layout(trainer: L.Trainer, sites: Iterable[str]) -> None:
    """Write the custom-scalars layout once per run to every TensorBoard logger."""
    layout = discrepancy_layout(sites)
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_custom_scalars"):
            experiment.add_custom_scalars(layout)


HEATMAP_FLOOR = 1e-6
"""Disagreements below this (and exact agreement) take the scale's lowest colour and read "0" or their value."""


def agreement_heatmap(own_codes: Mapping[tuple[int, str], float], used_values: Mapping[tuple[int, str], float],
                      step: int) -> Any:
    """Two layer x site heatmaps, stacked (training's own codes, the values it used), of the fraction of elements
    that differ from the rollout's on a log colour scale from 1e-6 to 1: a few elements in a million are visible.
    About 360 px wide, the width of TensorBoard's image card, so it reads without "Show actual image size"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers = sorted({layer for layer, _ in own_codes})
    sites = [s for s in SITE_ORDER if any(site == s for _, site in own_codes)]
    annotate = len(layers) <= 8
    panel = 0.16 * len(layers) + 0.9
    fig, axes = plt.subplots(2, 1, figsize=(3.6, min(2 * panel + 0.9, 16)), squeeze=False, layout="constrained",
                             dpi=100)
    panels = (("own RNE codes \u2260 rollout's", own_codes), ("values used \u2260 rollout's", used_values))
    norm = LogNorm(vmin=HEATMAP_FLOOR, vmax=1.0)
    for ax, (title, values) in zip(axes[:, 0], panels, strict=True):
        grid = [[1.0 - values.get((layer, site), math.nan) for site in sites] for layer in layers]
        shown = [[max(v, HEATMAP_FLOOR) if not math.isnan(v) else math.nan for v in row] for row in grid]
        image = ax.imshow(shown, norm=norm, cmap="magma_r", aspect="auto", interpolation="nearest")
        for i, row in enumerate(grid if annotate else []):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, "0" if v <= 0 else f"{v:.0e}".replace("e-0", "e-"), ha="center", va="center",
                            fontsize=6, color="white" if v > 1e-2 else "black")
        ax.set_xticks(range(len(sites)), sites, rotation=30, ha="right", fontsize=6.5)
        ax.set_yticks(range(len(layers)), [f"L{layer}" for layer in layers], fontsize=6.5)
        ax.set_title(title, fontsize=7.5)
    bar = fig.colorbar(image, ax=axes[:, 0].tolist(), orientation="horizontal", shrink=0.9, aspect=30)
    bar.set_label("fraction of elements that differ (1 - agreement)", fontsize=6.5)
    bar.ax.tick_params(labelsize=6.5)
    fig.suptitle(f"audit at step {step}", fontsize=7.5)
    plt.close(fig)
    return fig


__all__ = ["RunLogger", "agreement_heatmap", "discrepancy_layout", "log_measured", "tensorboard_tags", "write_layout"]
