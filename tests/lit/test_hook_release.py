"""A step keeps each micro-batch's hook until it ends, for its audit counts only: not the record the forward read."""

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from trace_lightning.guidance import GuidedHook
from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule


class HookSpy(L.Callback):
    """Every micro-batch hook of each RL step, as rl_step hands them over."""

    def __init__(self) -> None:
        self.hooks: list[Any] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch):
            step = module.rl_micro_step

            def spied(*args: Any, **kwargs: Any) -> dict[str, Any]:
                out = step(*args, **kwargs)
                self.hooks.append(out["hook"])
                return out

            module.rl_micro_step = spied

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        module.__dict__.pop("rl_micro_step", None)


def test_micro_batch_hooks_release_their_records_and_keep_their_audit(tmp_path: Path) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace", audit_every=3),
                          rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
                          warmup_steps=2, cpu_threads=1, micro_batch_size=2)
    spy = HookSpy()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, callbacks=[*default_callbacks(), spy], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8))
    guided = [h for h in spy.hooks if isinstance(h, GuidedHook)]
    assert len(guided) == 8  # 2 RL steps x 4 micro-batches of 2
    assert all(h.record is None and h.audit_record is None and h.valid_mask is None for h in guided)
    assert any(h.agreement for h in guided)  # step 3 audited: the counts stay
    with pytest.raises(RuntimeError, match="after release"):
        guided[0].activation(torch.zeros(1, 1, 16), layer=0, site="attn_in")
