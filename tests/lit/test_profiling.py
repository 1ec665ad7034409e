"""StepProfiler: one chosen step of a real fit profiled, its ops written beside the TensorBoard logs."""

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from torch.autograd import DeviceType

from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.profiling import StepProfiler, host_and_device
from trace_lightning.lit.tensorboard import RunLogger


def test_profiles_the_chosen_rl_step_only(tmp_path: Path) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"),
                          rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
                          warmup_steps=2, cpu_threads=1)
    profiler = StepProfiler(step=2, rows=10)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=[*default_callbacks(), profiler],
                        logger=RunLogger(str(tmp_path), name="fit"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8))
    assert profiler.path == Path(trainer.log_dir) / "profile_step2.txt"
    assert [p.name for p in Path(trainer.log_dir).glob("profile_*")] == ["profile_step2.txt"]
    lines = profiler.path.read_text().splitlines()
    assert lines[0] == "step 2, cpu, sorted by self_cpu_time_total"
    ops = [line.split()[0] for line in lines if line.strip().startswith("aten::")]
    assert len(ops) == 10  # rows
    assert "aten::mm" in ops  # the policy's projections, forward and backward


@pytest.mark.parametrize(("kwargs", "message"), [({"step": -1}, "step must be >= 0"),
                                                 ({"step": 0, "rows": 0}, "rows must be >= 1")])
def test_bad_arguments_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepProfiler(**kwargs)


def test_the_host_and_device_line_counts_kernels_once_and_names_launches_and_syncs() -> None:
    """Device busy time is the device events' own time only (an op's row carries its kernels' too); launches and
    host syncs are the runtime calls' counts."""

    def row(key: str, count: int, device: DeviceType, self_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, device_type=device, self_device_time_total=self_us)

    averages = [row("aten::mm", 3, DeviceType.CPU, 0.0), row("sm90_gemm", 3, DeviceType.CUDA, 1500.0),
                row("triton_kernel", 2, DeviceType.CUDA, 500.0), row("cudaLaunchKernel", 3, DeviceType.CPU, 0.0),
                row("cuLaunchKernelEx", 2, DeviceType.CPU, 0.0), row("cudaStreamSynchronize", 4, DeviceType.CPU, 0.0),
                row("cudaMemcpy", 1, DeviceType.CPU, 0.0), row("cudaMemcpyAsync", 7, DeviceType.CPU, 0.0)]
    line = host_and_device(averages, 0.0123)
    assert line == "wall 12.3 ms (profiler on), device busy 2.0 ms, 5 kernel launches, 5 host syncs"
