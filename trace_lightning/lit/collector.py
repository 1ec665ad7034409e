"""Python's cyclic garbage collector: its time logged, and optionally run between training steps only.

A training step's forward and backward create and drop tens of thousands of Python objects (autograd nodes, the
hooks' straight-through functions, Triton's launch arguments), and the automatic collector runs whenever enough have
piled up: a pause of the host thread that enqueues the GPU's work, which no profiler table shows. ``time/gc_s`` logs
what it cost each step. Measured (docs/benchmarks.md, 2026-12-08): 12 ms of a guided micro-step in the micro-step
bench on an H100, but only 0.04 s of a 19 s step in the long fit there; 2.4 ms a step on average on the CPU's sim fit
(400 steps, one collection of 0.3 s among them). With
``manual`` the automatic collector is off while the fit runs and each step ends with a full collection, so a step's
cyclic garbage (which may hold its records or a rollout's buffers) lives one step at most; what the fit's setup built
is frozen first (gc.freeze), so those collections scan only what the steps made. That keeps every pause out of the
steps, at a price that grows with what the steps keep alive (9 ms a step on the sim fit's 400 steps): for a fit whose
``time/gc_s`` shows the automatic collector's pauses mattering.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import lightning as L

from trace_lightning.lit.tensorboard import log_measured


class CollectorTime:
    """Seconds the cyclic collector has run since the last take(), automatic and explicit collections alike (from
    gc.callbacks, which the interpreter calls at each collection's start and stop)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started: float | None = None

    def __enter__(self) -> CollectorTime:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:  # noqa: ARG002 (gc.callbacks' signature)
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1
            self._started = None

    def take(self) -> tuple[float, int]:
        """(seconds, collections) since the last take."""
        out = (self.seconds, self.collections)
        self.seconds, self.collections = 0.0, 0
        return out


class GarbageCollection(L.Callback):
    """The cyclic collector's time a step (``time/gc_s``), left automatic (the default) or run between steps only.

    Args:
        manual: Freeze what setup built, turn the automatic collector off for the fit and collect fully after each
            step. False leaves the collector as it is and logs what its pauses cost.
    """

    def __init__(self, manual: bool = False) -> None:
        self.manual = manual
        self.timer = CollectorTime()
        self._was_enabled: bool | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer.__enter__()
        if self.manual and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.collect()  # what setup left, once, before freezing the rest
            gc.freeze()
            gc.disable()
        self.timer.take()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.manual:
            gc.collect()
        seconds, _ = self.timer.take()
        log_measured(pl_module, {"time/gc_s": seconds}, trainer.global_step - 1)  # global_step counts this step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """The collector as the fit found it (a fit in a notebook or a test must not leave it off or frozen)."""
        self.timer.__exit__()
        if self._was_enabled is not None:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
        self._was_enabled = None
