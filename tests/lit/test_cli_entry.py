"""The console command itself: `trace-rl fit` with the shipped config runs and exits 0."""

import subprocess
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf" / "sim.yaml"


def test_trace_rl_fit_exits_zero(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "trace_lightning.lit.cli", "fit", "--config", str(CONF),
           "--trainer.max_steps", "3", "--model.warmup_steps", "2", "--trainer.val_check_interval", "3",
           "--trainer.limit_val_batches", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
           "--model.rollout.prompts_per_step", "2"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "runs" / "sim").glob("version_*/events.out.tfevents.*"))
