"""The console command itself: `trace-rl fit` runs and exits 0, `predict` writes clean JSON, misuse is one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_lightning.lit.cli import entry

CONF = Path(__file__).resolve().parents[2] / "conf" / "sim.yaml"
TINY = ["--trainer.max_steps", "3", "--model.warmup_steps", "2", "--trainer.val_check_interval", "3",
        "--trainer.limit_val_batches", "1", "--model.rollout.prompts_per_step", "2"]


def _trace_rl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trace_lightning.lit.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a whole run or many processes: CI runs it in its slow pass
def test_fit_then_predict_from_its_checkpoint(tmp_path: Path) -> None:
    fit = _trace_rl("fit", "--config", str(CONF), *TINY, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert "steps 2-2: RL with trace_compact (1 steps)" in fit.stderr
    assert "run summary: 3 steps" in fit.stderr and "mean k3_kl over 1 RL steps" in fit.stderr
    assert "Tip:" not in fit.stderr + fit.stdout
    (run,) = (tmp_path / "runs" / "trace_compact-arithmetic-debug-moe").glob("version_*")  # method-task-model
    assert list(run.glob("events.out.tfevents.*"))
    (ckpt,) = run.glob("checkpoints/*.ckpt")

    pred = _trace_rl("predict", "--config", str(CONF), "--ckpt_path", str(ckpt),
                     "--trainer.limit_predict_batches", "1", "--data.eval_size", "3", cwd=tmp_path)
    assert pred.returncode == 0, pred.stderr[-2000:]
    rows = [json.loads(line) for line in pred.stdout.splitlines()]  # every stdout line is JSON
    assert len(rows) == 3 and set(rows[0]) == {"prompt", "response", "answer"}
    assert list((tmp_path / "runs").rglob("version_*")) == [run]  # predicting adds no run folder
    assert not (tmp_path / "config.yaml").exists()


def _misuse(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setattr(sys, "argv", ["trace-rl", *args])
    with pytest.raises(SystemExit) as exit_info:
        entry()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err
    return err.splitlines()[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--model.trace.method", "fp5"], "fp4_qat"),
    (["--model.rl.advantage", "ppo"], "rloo"),
    (["--data.env", "nope"], "arithmetic"),
    (["--model.model", "huge"], "debug-moe"),
    (["--model.checkpoint", "/nonexistent"], "config.json"),
    (["--trainer.max_stepz", "3"], "max_stepz"),
])
def test_a_bad_fit_value_is_one_line_naming_it(args: list[str], expected: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    line = _misuse(["fit", "--config", str(CONF), *args], monkeypatch, capsys)
    assert line.startswith("trace-rl fit: error:") and expected in line


def test_predict_without_a_checkpoint_refuses_random_weights(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    line = _misuse(["predict", "--config", str(CONF)], monkeypatch, capsys)
    assert "--ckpt_path" in line


def test_test_subcommand_is_gone(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    line = _misuse(["test", "--config", str(CONF)], monkeypatch, capsys)
    assert "fit" in line and "validate" in line and "predict" in line


def test_fit_help_explains_the_project_and_every_field(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["trace-rl", "fit", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        entry()
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "FP4 rollouts" in out
    for docstring in ("Distinct prompts per step", "Guidance layer policy", "Advantage estimator",
                      "Supervised warm-start steps before RL", "Task name"):
        assert docstring in out, docstring
    head = out[:1500]  # what `trace-rl fit --help | head` shows: the project's options, not Lightning's flags
    assert "[--model.* ...] [--data.* ...] [--trainer.* ...]" in head and "--trainer.accelerator" not in head
    assert out.index("--model.model") < out.index("--data.env") < out.index("--trainer.accelerator")


@pytest.mark.slow
def test_fit_logs_its_scalars_and_validate_evaluates_its_checkpoint(tmp_path: Path) -> None:
    """The event file holds the run's judged scalars, finite, at the RL step; `trace-rl validate` from the checkpoint
    logs FP4 and BF16 eval accuracy."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit = _trace_rl("fit", "--config", str(CONF), *TINY, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    (run,) = (tmp_path / "runs" / "trace_compact-arithmetic-debug-moe").glob("version_*")

    def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    logged = scalars(run)
    for tag in ("train/loss", "reward/mean", "mismatch/k3_kl", "time/train_s", "time/rollout_s", "time/sync_s",
                "time/record_check_s", "rollout/tokens_per_s", "train/tokens_per_s", "eval/accuracy"):
        assert tag in logged and [step for step, _ in logged[tag]][-1] == 2, tag  # the one RL step (step 2)
    # the BF16 engine's eval accuracy: the same tag in the bf16_reference sub-run (one chart, two colours)
    assert [step for step, _ in scalars(run / "bf16_reference")["eval/accuracy"]][-1] == 2
    assert all(v == v and abs(v) != float("inf") for values in logged.values() for _, v in values)
    # wall time: a step's whole span (logged when the next starts), and making its batch (warm-up or rollout)
    assert [step for step, _ in logged["time/step_s"]] == [0, 1]
    assert [step for step, _ in logged["time/batch_s"]] == [0, 1, 2]
    rollout, batch = logged["time/rollout_s"][-1][1], logged["time/batch_s"][-1][1]
    assert logged["time/step_s"][-1][1] >= batch >= rollout > 0  # step 1's span holds step 2's rollout
    k3 = logged["mismatch/k3_kl"][-1][1]
    assert 0.0 <= k3 < 1e-4  # guided FP4 training against its own FP4 rollout: logprob noise only
    (ckpt,) = run.glob("checkpoints/*.ckpt")
    val = _trace_rl("validate", "--config", str(CONF), "--ckpt_path", str(ckpt), "--trainer.limit_val_batches", "1",
                    "--data.eval_size", "4", cwd=tmp_path)
    assert val.returncode == 0, val.stderr[-2000:]
    assert "eval/accuracy" in val.stdout + val.stderr
