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


def test_fit_then_predict_from_its_checkpoint(tmp_path: Path) -> None:
    fit = _trace_rl("fit", "--config", str(CONF), *TINY, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert "steps 2-2: RL with trace_compact (1 steps)" in fit.stderr
    assert "run summary: 3 steps" in fit.stderr and "mean k3_kl over 1 RL steps" in fit.stderr
    assert "Tip:" not in fit.stderr + fit.stdout
    (run,) = (tmp_path / "runs" / "trace_compact").glob("version_*")  # runs/<method>/version_N
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
