"""A few-step trace_exact fit: every RL step's mismatch is exactly zero, and nothing is recorded."""

from pathlib import Path

import lightning as L
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.tensorboard import RunLogger


def test_trace_exact_fit_logs_exactly_zero_mismatch_and_no_record(tmp_path: Path) -> None:
    module = PolicyModule(
        trace=TraceConfig(method="trace_exact", audit_every=2, route_replay=False),
        rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
        warmup_steps=2,
        cpu_threads=1,
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, callbacks=default_callbacks(), logger=RunLogger(str(tmp_path), name="fit"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8))
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    values = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for key in ("mismatch/k3_kl", "mismatch/logprob_abs_diff"):
        assert values[key] == {2: 0.0, 3: 0.0, 4: 0.0}, key
    assert values["guidance/exchange_bytes"] == {2: 0.0, 3: 0.0, 4: 0.0}
    assert not any(tag.startswith("agreement/") for tag in values)  # no audit record either
    assert module.worker.capture_spec() is None
