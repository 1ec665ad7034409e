"""TensorBoard that shows the train-rollout discrepancy at a glance.

Lightning writes every value ever logged in an epoch again at each logging step, and an RL run is one
endless epoch, so a value measured once (an audit, the warm start's loss) would be drawn as if measured at
every later step. Training metrics therefore go to TensorBoard through `log_measured`, at the step they were
measured and only then; Lightning's own path keeps them for the progress bar and callbacks (`logger=False`).

Ratios that live near 1 (ess, is_ratio, token_mult_prob_error) are drawn as their distance from 1, whose
axis reads 1e-3 instead of "1 1 1 1". The custom-scalars layout puts each discrepancy on one chart next to
its BF16 reference and each site's per-layer agreements on one chart; the heatmap shows layer x site
agreement at audit steps.
"""

from __future__ import annotations

import math
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


REFERENCE_PREFIX = "mismatch_bf16/"
"""Metrics of the BF16 reference; RunLogger writes them as `mismatch/*` of a sub-run `bf16_reference`."""


class RunLogger(TensorBoardLogger):
    """TensorBoard under save_dir/<name>/version_N without Lightning's `epoch` and `hp_metric` tags.

    `trace-rl` names the run after its method, task and model (runs/trace_compact-arithmetic-debug-moe/version_0,
    lit.runs), so one `tensorboard --logdir runs` overlays methods and tells runs apart. The BF16 reference (`mismatch_bf16/*`) goes to the sub-run
    version_N/bf16_reference under the `mismatch/*` tags, so every dashboard draws it on the same chart as the
    FP4 rollout's mismatch, in its own colour.
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
        self._reference: Any = None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        reference = {"mismatch/" + k.removeprefix(REFERENCE_PREFIX): v for k, v in metrics.items()
                     if k.startswith(REFERENCE_PREFIX)}
        own = {k: v for k, v in metrics.items() if k != "epoch" and not k.startswith(REFERENCE_PREFIX)}
        super().log_metrics(own, step)
        if reference and self._writes():
            for tag, value in reference.items():
                self.reference_writer().add_scalar(tag, value, step)

    def _writes(self) -> bool:
        return self.experiment is not None and hasattr(self.experiment, "add_scalar")

    def reference_writer(self) -> Any:
        """The SummaryWriter of the bf16_reference sub-run, made on first use."""
        if self._reference is None:
            self._reference = type(self.experiment)(log_dir=f"{self.log_dir}/bf16_reference")
        return self._reference

    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._reference is not None:
            self._reference.close()


def tensorboard_tags(metrics: Mapping[str, float | Tensor]) -> dict[str, float]:
    """Floats under their TensorBoard tags (mismatch ratios near 1 as their distance from 1), NaNs left out."""
    out = {}
    for key, value in metrics.items():
        x = float(value)
        if math.isnan(x):
            continue
        family, _, name = key.partition("/")
        if family in ("mismatch", "mismatch_bf16") and name in NEAR_ONE:
            tag, sign = NEAR_ONE[name]
            out[f"{family}/{tag}"] = sign * (x - 1.0)
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
    """The custom-scalars layout (TensorBoard's CUSTOM SCALARS tab): one multi-line chart per question."""
    # The BF16 reference is the run's bf16_reference sub-run under the same tags (RunLogger), so each chart
    # draws the FP4 rollout's mismatch and the reference in two colours.
    mismatch = {
        "k3_kl: FP4 rollout vs training (run) and BF16 rollout (run/bf16_reference)": ["mismatch/k3_kl$"],
        "|logprob difference| per token": ["mismatch/logprob_abs_diff$"],
        "token_mult_prob_error - 1": ["mismatch/token_mult_prob_error_minus_one$"],
        "1 - ess (effective sample size lost)": ["mismatch/one_minus_ess$"],
        "importance ratio extremes (max - 1, 1 - min)": ["mismatch/is_ratio_max_minus_one$",
                                                          "mismatch/one_minus_is_ratio_min$"],
    }
    agreement = {
        f"{site}: per layer, own codes and used values = rollout's": [
            rf"agreement_per_layer/own_codes/layer\d+/{site}$", rf"agreement_per_layer/used_values/layer\d+/{site}$"]
        for site in sites
    }
    agreement["all sites: own codes, used values, routes"] = [
        "agreement/own_codes$", "agreement/used_values$", "moe/route_agreement$"]
    learning = {
        "reward": ["reward/mean$"],
        "eval accuracy: FP4 engine vs BF16 engine": ["eval/accuracy$", "eval/bf16_accuracy$", "eval/ptq_accuracy$"],
    }
    return {
        "1 train-rollout mismatch": {title: ["Multiline", tags] for title, tags in mismatch.items()},
        "2 quantization agreement (audit steps)": {title: ["Multiline", tags] for title, tags in agreement.items()},
        "3 learning": {title: ["Multiline", tags] for title, tags in learning.items()},
    }


def write_layout(trainer: L.Trainer, sites: Iterable[str]) -> None:
    """Write the custom-scalars layout once per run to every TensorBoard logger."""
    layout = discrepancy_layout(sites)
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_custom_scalars"):
            experiment.add_custom_scalars(layout)


def agreement_heatmap(own_codes: Mapping[tuple[int, str], float], used_values: Mapping[tuple[int, str], float],
                      step: int) -> Any:
    """Two layer x site heatmaps (training's own codes, the values it used) of the fraction equal to the rollout's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({layer for layer, _ in own_codes})
    sites = [s for s in SITE_ORDER if any(site == s for _, site in own_codes)]
    fig, axes = plt.subplots(1, 2, figsize=(2.4 * len(sites) + 2, 0.6 * len(layers) + 2), squeeze=False,
                             layout="constrained")
    panels = (("training's own RNE codes = rollout's", own_codes), ("values training used = rollout's", used_values))
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        grid = [[100 * values.get((layer, site), math.nan) for site in sites] for layer in layers]
        image = ax.imshow(grid, vmin=90, vmax=100, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(sites)), sites, rotation=30)
        ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="% of elements equal (colour from 90)", shrink=0.9)
    fig.suptitle(f"audit at step {step}", fontsize=9)
    plt.close(fig)
    return fig


__all__ = ["RunLogger", "agreement_heatmap", "discrepancy_layout", "log_measured", "tensorboard_tags", "write_layout"]
