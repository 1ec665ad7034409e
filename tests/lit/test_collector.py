"""GarbageCollection: Python's cyclic collector off inside a real fit's steps, run (and timed) between them, and left
as the fit found it; CollectorTime times collections from the interpreter's own callbacks."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import lightning as L

from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.collector import CollectorTime, GarbageCollection
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.tensorboard import RunLogger


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_collector_time_counts_each_collection_and_unhooks_itself() -> None:
    with CollectorTime() as timer:
        for _ in range(50):
            _Cycle()
        gc.collect()
        gc.collect(0)
    assert timer.collections == 2 and timer.seconds > 0
    assert timer._on_collection not in gc.callbacks
    seconds = timer.seconds
    gc.collect()
    assert timer.take() == (seconds, 2)  # nothing counted after the block
    assert timer.take() == (0.0, 0)


class _SeesCollector(L.Callback):
    """Whether the automatic collector was on at each step's start (after the data module made the batch), and
    whether the cyclic garbage each step leaves was gone by the next step's start."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.collected: list[bool] = []
        self._garbage: weakref.ref | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.enabled.append(gc.isenabled())
        if self._garbage is not None:
            self.collected.append(self._garbage() is None)
        self._garbage = weakref.ref(_Cycle())  # unreachable at once, but a cycle: only a collection frees it


def _fit(tmp_path: Path, collector: GarbageCollection) -> tuple[L.Trainer, _SeesCollector]:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"),
                          rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
                          warmup_steps=1, cpu_threads=1)
    seen = _SeesCollector()
    trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=[*default_callbacks(), collector, seen],
                        logger=RunLogger(str(tmp_path), name="fit"), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8))
    return trainer, seen


def test_the_collector_is_off_in_the_steps_timed_between_them_and_restored(tmp_path: Path) -> None:
    assert gc.isenabled()
    collector = GarbageCollection(manual=True)
    trainer, seen = _fit(tmp_path, collector)
    assert seen.enabled == [False, False, False]
    assert seen.collected == [True, True]  # each step's cyclic garbage collected at its end
    assert gc.isenabled() and gc.get_freeze_count() == 0 and collector.timer._on_collection not in gc.callbacks
    assert trainer.callback_metrics["time/gc_s"] > 0  # the last step's collection, timed


def test_by_default_the_collector_stays_automatic_and_is_timed(tmp_path: Path) -> None:
    trainer, seen = _fit(tmp_path, GarbageCollection())
    assert seen.enabled == [True, True, True] and gc.isenabled()
    assert "time/gc_s" in trainer.callback_metrics

