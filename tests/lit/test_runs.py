"""Run folders: named after method, task and model; a resume continues its version; validate and predict write
none unless asked; the progress bar and summary of a resumed fit count from where it left off."""

import functools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from jsonargparse import Namespace

from trace_lightning.lit.cli import main
from trace_lightning.lit.console import RLProgressBar, RunSummary
from trace_lightning.lit.runs import run_name, run_of_checkpoint

from .conftest import one_step_checkpoint

CONF = Path(__file__).resolve().parents[2] / "conf" / "sim.yaml"
TINY = ["--model.warmup_steps", "2", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--model.rollout.prompts_per_step", "2", "--model.rollout.group_size", "2"]


def config(**model: object) -> Namespace:
    return Namespace(model=Namespace(**model), data=Namespace(env="countdown"))


def test_run_name_says_method_task_and_model() -> None:
    assert run_name(config(model="debug-moe", trace=Namespace(method="fp4_qat"))) == "fp4_qat-countdown-debug-moe"
    hf = config(model="debug-moe", checkpoint="/ckpts/Qwen3 30B/", trace=Namespace(method="bf16"))
    assert run_name(hf) == "bf16-countdown-Qwen3_30B"  # the checkpoint folder's name, made path-safe
    gym = Namespace(model=Namespace(model="debug-moe"), data=Namespace(env="reasoning_gym",
                                                                        env_kwargs={"dataset": "spiral_matrix"}))
    assert run_name(gym) == "trace_compact-spiral_matrix-debug-moe"


def test_run_of_checkpoint_finds_the_version_folder(tmp_path: Path) -> None:
    ckpt = tmp_path / "runs" / "bf16-arithmetic-debug-moe" / "version_3" / "checkpoints" / "last.ckpt"
    assert run_of_checkpoint(ckpt) == (tmp_path / "runs", "bf16-arithmetic-debug-moe", 3)
    assert run_of_checkpoint(tmp_path / "elsewhere" / "last.ckpt") is None
    assert run_of_checkpoint(tmp_path / "runs" / "r" / "latest" / "checkpoints" / "last.ckpt") is None


def cli_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> str | None:
    """The log folder `trace-rl ARGS` sets up (the subcommand itself is not run)."""
    monkeypatch.chdir(tmp_path)
    for name in ("fit", "validate"):
        monkeypatch.setattr(L.Trainer, name, functools.wraps(getattr(L.Trainer, name))(lambda *a, **k: None))
    cli = main([args[0], "--config", str(CONF), *TINY, *args[1:]])
    return cli.trainer.logger.log_dir if cli.trainer.logger else None


def test_fit_logs_to_a_folder_named_after_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = cli_log_dir(tmp_path, monkeypatch, "fit", "--model.trace.method", "fp4_qat")
    assert log_dir == "runs/fp4_qat-arithmetic-debug-moe/version_0"


def test_a_resume_logs_on_in_its_checkpoints_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "old" / "bf16-arithmetic-debug-moe" / "version_4" / "checkpoints" / "last.ckpt"
    one_step_checkpoint(ckpt)
    log_dir = cli_log_dir(tmp_path, monkeypatch, "fit", "--ckpt_path", str(ckpt))
    assert log_dir == str(tmp_path / "old" / "bf16-arithmetic-debug-moe" / "version_4")


def test_validate_writes_no_run_folder_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_log_dir(tmp_path, monkeypatch, "validate") is None
    asked = cli_log_dir(tmp_path, monkeypatch, "validate", "--log_run", "true")
    assert asked == "runs/trace_compact-arithmetic-debug-moe/version_0"


def test_a_missing_ckpt_path_is_refused_before_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--ckpt_path nope.ckpt: no such file"):
        cli_log_dir(tmp_path, monkeypatch, "fit", "--ckpt_path", "nope.ckpt")
    assert not (tmp_path / "runs").exists()


def test_progress_bar_total_is_max_steps_and_summary_counts_from_the_resume() -> None:
    bar = RLProgressBar()
    bar._trainer = SimpleNamespace(max_steps=10)
    assert bar.total_train_batches == 10
    summary = RunSummary()
    summary.first_step = 6
    trainer = SimpleNamespace(global_step=10, callback_metrics={}, logger=None, checkpoint_callback=None)
    line = summary.summary_lines(trainer)[1]
    assert line.startswith("run summary: steps 6-9 (4 steps, resumed at step 6; 10 in all)")


@pytest.mark.slow  # two fits and a validate in subprocesses
def test_fit_resume_and_validate_leave_one_run(tmp_path: Path) -> None:
    def trace_rl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trace_lightning.lit.cli", args[0], "--config", str(CONF),
                               *TINY, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    first = trace_rl("fit", "--trainer.max_steps", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    run = tmp_path / "runs" / "trace_compact-arithmetic-debug-moe" / "version_0"
    resumed = trace_rl("fit", "--trainer.max_steps", "5", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "run summary: steps 3-4 (2 steps, resumed at step 3; 5 in all)" in resumed.stderr
    assert "5/5" in resumed.stderr and "dirpath has changed" not in resumed.stderr
    validated = trace_rl("validate", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    assert validated.returncode == 0, validated.stderr[-2000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.parent.name]
    assert [p.name for p in run.parent.iterdir()] == ["version_0"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # one file per process, one run in TensorBoard
    assert not (tmp_path / "config.yaml").exists()
