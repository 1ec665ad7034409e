"""Shared by the CLI tests: a real trace-rl checkpoint, cheaply."""

from pathlib import Path

import lightning as L

from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule


def one_step_checkpoint(path: Path, weights_only: bool = False) -> PolicyModule:
    """Train debug-moe one warm-start step and save its Lightning checkpoint at `path`; -> the trained module."""
    module = PolicyModule(rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=2), warmup_steps=1,
                          cpu_threads=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=default_callbacks())
    trainer.fit(module, datamodule=RLDataModule(demo_batch_size=4, eval_size=4))
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path)
    if weights_only:
        trainer.save_checkpoint(path.with_name(f"{path.stem}_weights_only{path.suffix}"), weights_only=True)
    return module
