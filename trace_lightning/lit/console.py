"""What `trace-rl` prints: a progress bar that speaks RL, the run's plan, a summary at the end, no tips.

The plan names the step where the supervised warm start ends and RL begins (and says so when no RL step will
run); the progress bar reads "warm start" or "RL" with that phase's fields; the summary gives the final FP4 and
BF16 eval accuracy, the mean k3_kl of the RL steps and where the logs and checkpoints are. Progress and plan go to
stderr, so `trace-rl predict`'s stdout holds only its JSON lines.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.tensorboard import UNSMOOTHED_URL_SUFFIX
from trace_lightning.rl import MismatchMetric

PHASE_FIELDS = {
    "warm start": {"train/sft_loss": "sft_loss", "eval/accuracy": "fp4_acc", "eval/bf16_accuracy": "bf16_acc"},
    "RL": {"reward/mean": "reward", "mismatch/k3_kl": "k3_kl", "eval/accuracy": "fp4_acc",
           "eval/bf16_accuracy": "bf16_acc"},
}
"""Progress-bar fields per phase: logged key -> short label."""


def say(line: str) -> None:
    """A console line of the run (stderr, beside the progress bar)."""
    print(line, file=sys.stderr, flush=True)


def phase(module: Any) -> str:
    """"warm start" while the next step is supervised, "RL" after."""
    return "warm start" if module.in_warmup() else "RL"


class RLProgressBar(RichProgressBar):
    """The Rich bar on stderr, described by phase ("warm start" / "RL") and showing only that phase's fields."""

    def __init__(self) -> None:
        super().__init__(console_kwargs={"stderr": True})
        self._phase: str | None = None

    def _get_train_description(self, current_epoch: int) -> str:
        return phase(self.trainer.lightning_module)

    @property
    def total_train_batches(self) -> int | float:
        """max_steps: an RL run is one endless epoch whose batch count is the step, so a resumed run reads
        "7/10" from where it left off (Lightning's own total is the steps left, which read "10/4")."""
        max_steps = self.trainer.max_steps
        return max_steps if max_steps is not None and max_steps > 0 else super().total_train_batches

    def get_metrics(self, trainer: L.Trainer, pl_module: Any) -> dict[str, Any]:
        fields = PHASE_FIELDS[phase(pl_module)]
        measured = trainer.callback_metrics
        return {label: f"{float(measured[key]):.3g}" for key, label in fields.items() if key in measured}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = phase(pl_module)
        if now != self._phase and self._phase is not None and self.progress is not None:
            self.progress.update(self.train_progress_bar_id, description=now)
            self._console.print(f"step {trainer.global_step}: warm start done, RL begins "
                                f"({pl_module.method.name} rollouts)", style="bold")
        self._phase = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class RunSummary(L.Callback):
    """Prints the run's plan when training starts and a summary when fit ends."""

    def __init__(self) -> None:
        self.mismatch = MismatchMetric()
        self.rl_steps = 0
        self.eval_step: int | None = None
        self._start = time.perf_counter()
        self.first_step = 0

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        self._start = time.perf_counter()
        self.first_step = trainer.global_step
        for line in plan_lines(trainer.global_step, trainer.max_steps, module.warmup_steps, module.method.name):
            say(line)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch) and isinstance(outputs, dict):
            self.mismatch.update(outputs["logprobs"].cpu(), batch.rollout_logprobs.cpu(), batch.response_mask.cpu())
            self.rl_steps += 1

    def on_validation_end(self, trainer: L.Trainer, module: Any) -> None:
        if not trainer.sanity_checking:
            self.eval_step = trainer.global_step

    def teardown(self, trainer: L.Trainer, module: Any, stage: str) -> None:
        if stage == "fit":  # after the progress bar has stopped, so the summary is the last thing printed
            for line in self.summary_lines(trainer):
                say(line)

    def summary_lines(self, trainer: L.Trainer) -> list[str]:
        minutes, seconds = divmod(int(time.perf_counter() - self._start), 60)
        took = f"in {minutes} min {seconds} s"
        ran = trainer.global_step - self.first_step
        lines = ["", f"run summary: {ran} steps {took}" if not self.first_step else
                 f"run summary: steps {self.first_step}-{trainer.global_step - 1} ({ran} steps, resumed at step "
                 f"{self.first_step}; {trainer.global_step} in all) {took}"]
        metrics = trainer.callback_metrics
        if self.eval_step is not None and "eval/accuracy" in metrics:
            lines.append(f"  eval accuracy at step {self.eval_step}: FP4 engine {float(metrics['eval/accuracy']):.3f},"
                         f" BF16 engine {float(metrics.get('eval/bf16_accuracy', float('nan'))):.3f}")
        else:
            lines.append("  eval accuracy: not measured (no validation ran; see --trainer.val_check_interval)")
        if self.rl_steps:
            k3 = float(self.mismatch.compute()["mismatch/k3_kl"])
            lines.append(f"  mean k3_kl over {self.rl_steps} RL steps (all response tokens): {k3:.3g}")
        else:
            lines.append("  no RL step ran (the run ended inside the warm start)")
        if trainer.logger is not None and trainer.log_dir:
            lines.append(f"  TensorBoard logs: {trainer.log_dir}  (tensorboard --logdir {trainer.logger.save_dir}, "
                         f"then open http://localhost:6006/{UNSMOOTHED_URL_SUFFIX})")
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", "")
        lines.append(f"  checkpoint: {checkpoint}" if checkpoint else "  checkpoint: none saved")
        return lines


def plan_lines(start: int, max_steps: int, warmup_steps: int, method: str) -> list[str]:
    """What the run will do: the warm-start and RL step ranges, or that no RL step will run."""
    if max_steps is None or max_steps < 0:
        return [f"steps {start}-{warmup_steps - 1}: supervised warm start; then RL ({method}) without a step limit"]
    if max_steps <= warmup_steps:
        return [f"note: --trainer.max_steps {max_steps} ends inside the {warmup_steps}-step warm start"
                f" (--model.warmup_steps): no RL step will run"]
    lines = []
    if start < warmup_steps:
        lines.append(f"steps {start}-{warmup_steps - 1}: supervised warm start")
    first_rl = max(start, warmup_steps)
    lines.append(f"steps {first_rl}-{max_steps - 1}: RL with {method} ({max_steps - first_rl} steps)")
    return lines


class _NoTips(logging.Filter):
    """Drops Lightning's advertising lines ("Tip: ... try installing litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in record.getMessage()


def quiet_lightning() -> None:
    """No Lightning tips on the console (their logger also carries useful lines, so filter), and none of the
    warnings every run gives: the module moves its own batches on purpose, a torch deprecation inside Lightning, and
    the note that a manually optimized module's checkpoint holds the state after the step (as ours should)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r"You have overridden `transfer_batch_to_device`")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Our manual optimization checkpoints after the optimizer step on purpose (a resume continues from there).
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")


__all__ = ["RLProgressBar", "RunSummary", "plan_lines", "quiet_lightning"]
