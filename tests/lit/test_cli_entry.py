"""The console command itself: `trace-rl fit` with the shipped config runs, exits 0 and logs the scalars the run
is judged by; `trace-rl validate` and `trace-rl predict` run from the checkpoint it wrote."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CONF = Path(__file__).resolve().parents[2] / "conf" / "sim.yaml"
pytestmark = pytest.mark.slow  # three runs of the console command, ~10 s each on 2 cores


def trace_rl(tmp_path: Path, command: str, *args: str) -> subprocess.CompletedProcess:
    """`trace-rl COMMAND --config conf/sim.yaml ARGS` (arguments after --config override it)."""
    cmd = [sys.executable, "-m", "trace_lightning.lit.cli", command, "--config", str(CONF),
           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--data.eval_size", "4",
           "--model.rollout.prompts_per_step", "2", *args]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step `trace-rl fit` (2 warm-start steps, 1 RL step, one validation): its run folder."""
    tmp_path = tmp_path_factory.mktemp("cli")
    trace_rl(tmp_path, "fit", "--trainer.max_steps", "3", "--model.warmup_steps", "2",
             "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
             "--trainer.log_every_n_steps", "1")
    (run,) = (tmp_path / "runs" / "sim").glob("version_*")
    return run


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_trace_rl_fit_logs_the_runs_scalars(fitted: Path) -> None:
    logged = scalars(fitted)
    assert [step for step, _ in logged["train/sft_loss"]][:2] == [0, 1]  # warm start: steps 0 and 1
    for tag in ("train/loss", "reward/mean", "mismatch/k3_kl", "mismatch/is_ratio_mean", "moe/route_agreement",
                "guidance/bytes_per_token", "eval/accuracy", "eval/bf16_accuracy"):
        assert [step for step, _ in logged[tag]] == [2], tag  # the one RL step, then the validation
    assert all(math.isfinite(v) for values in logged.values() for _, v in values)
    value = {tag: values[-1][1] for tag, values in logged.items()}
    assert value["train/sft_loss"] < logged["train/sft_loss"][0][1]  # the warm start's second step learned
    assert 0.0 <= value["reward/mean"] <= 1.0 and 0.0 <= value["eval/accuracy"] <= 1.0
    # Guided FP4 training against its FP4 rollout: logprob noise only (measured k3 8e-7, IS ratios within 0.3%).
    assert 0.0 <= value["mismatch/k3_kl"] < 1e-4 and abs(value["mismatch/is_ratio_mean"] - 1.0) < 1e-2
    assert value["moe/route_agreement"] == 1.0  # routes replayed
    assert list((fitted / "checkpoints").glob("*.ckpt"))


@pytest.mark.xfail(strict=True, reason="Lightning's step results keep a training_step key until it is logged "
                                       "again: train/sft_loss (warm start only) is re-logged at every RL step with "
                                       "step 1's value (also without validation)")
def test_trace_rl_fit_logs_the_supervised_loss_only_at_warm_start_steps(fitted: Path) -> None:
    assert [step for step, _ in scalars(fitted)["train/sft_loss"]] == [0, 1]


def test_trace_rl_validate_from_the_checkpoint(fitted: Path, tmp_path: Path) -> None:
    (ckpt,) = (fitted / "checkpoints").glob("*.ckpt")
    done = trace_rl(tmp_path, "validate", "--ckpt_path", str(ckpt), "--trainer.limit_val_batches", "1")
    (run,) = (tmp_path / "runs" / "sim").glob("version_*")
    logged = scalars(run)
    for tag in ("eval/accuracy", "eval/bf16_accuracy"):
        (value,) = logged[tag]
        assert 0.0 <= value[1] <= 1.0 and tag in done.stdout, tag


def test_trace_rl_predict_prints_one_json_line_per_sample(fitted: Path, tmp_path: Path) -> None:
    (ckpt,) = (fitted / "checkpoints").glob("*.ckpt")
    done = trace_rl(tmp_path, "predict", "--ckpt_path", str(ckpt), "--trainer.limit_predict_batches", "1")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4  # data.eval_size prompts, one batch
    assert all(set(row) == {"prompt", "response", "answer"} and isinstance(row["response"], str) for row in rows)
