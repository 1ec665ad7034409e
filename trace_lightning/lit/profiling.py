"""Where one training step's time goes inside a real fit: torch.profiler around a chosen step's training (forward,
backward and optimizer of every micro-batch; the rollout, which produces the batch, is not in it).

A synthetic benchmark (tools/bench_train.py) times a micro-step alone; this profiles the step the fit actually runs,
with its method's hook, records, padding, route replay and memory pressure, which is where the two can disagree.
Stack it on any fit:

    trace-rl fit --config conf/sim.yaml --trainer.callbacks+=trace_lightning.lit.profiling.StepProfiler \
        --trainer.callbacks.step=3
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""Runtime calls that block the host until the device has caught up (cudaMemcpy: a synchronous copy)."""


def host_and_device(averages: Any, wall_s: float) -> str:
    """Whether a profiled stretch was host- or device-bound: its wall time against the device's busy time (the
    sum of its kernels' own times: an op's row also carries its kernels', so summing every row counts them twice),
    with the kernel launches and the host syncs that set how far the host may run ahead."""
    launches = sum(a.count for a in averages if a.key in LAUNCH_CALLS)
    syncs = sum(a.count for a in averages if a.key in SYNC_CALLS)
    busy = sum(a.self_device_time_total for a in averages if a.device_type == DeviceType.CUDA) / 1e6
    return (f"wall {wall_s * 1e3:.1f} ms (profiler on), device busy {busy * 1e3:.1f} ms, {launches} kernel launches, "
            f"{syncs} host syncs")


class StepProfiler(L.Callback):
    """Profiles training step `step` (its global step) and writes the ops that took the most time, device time on a
    GPU (self time: a kernel counts once), to <log_dir>/profile_step<step>.txt; with `trace`, a Chrome trace beside it.

    Args:
        step: The global step to profile (a warm-start step, or an RL step: steps from warmup_steps on are RL).
        rows: How many ops the table lists.
        trace: Also write profile_step<step>.json (open in chrome://tracing or Perfetto); large for long steps.
    """

    def __init__(self, step: int, rows: int = 40, trace: bool = False) -> None:
        if step < 0:
            raise ValueError(f"StepProfiler step must be >= 0, got {step}")
        if rows < 1:
            raise ValueError(f"StepProfiler rows must be >= 1, got {rows}")
        self.step, self.rows, self.trace = step, rows, trace
        self._profiler: profile | None = None
        self._start = 0.0
        self.path: Path | None = None
        """The table written, once the step has run."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step != self.step or not trainer.is_global_zero:
            return
        cuda = pl_module.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._profiler is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        wall = time.perf_counter() - self._start
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        on_device = pl_module.device.type == "cuda"
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort, row_limit=self.rows, max_name_column_width=70)
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"profile_step{self.step}.txt"
        header = f"step {self.step}, {pl_module.device}, sorted by {sort}\n"
        if on_device:
            header += host_and_device(averages, wall) + "\n"
            # the host's side: where a step the device waits on spends its time (launches, syncs, Python-side ops)
            table += "\nsorted by self_cpu_time_total\n" + averages.table(
                sort_by="self_cpu_time_total", row_limit=self.rows, max_name_column_width=70)
        self.path.write_text(header + table)
        if self.trace:
            prof.export_chrome_trace(str(folder / f"profile_step{self.step}.json"))
        print(f"StepProfiler: step {self.step}'s training ops -> {self.path}", flush=True)
