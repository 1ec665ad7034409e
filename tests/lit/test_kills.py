"""Kills: SIGTERM/SIGINT save a resumable checkpoint and exit non-zero; checkpoint writes are atomic."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.signals import AtomicCheckpointIO, FitInterrupted, StopOnSignal, atomic_torch_save

CONF = Path(__file__).resolve().parents[2] / "conf" / "sim.yaml"


class StepLosses(L.Callback):
    """Each RL step's loss and mean reward, and the policy weights after the last step."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[float, float]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch):
            self.steps[trainer.global_step - 1] = (float(outputs["loss"]), float(batch.rewards.mean()))


class SignalAtStep(L.Callback):
    """Sends `signum` to this process at the end of step `step` (before StopOnSignal looks at its flag)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step + 1:
            os.kill(os.getpid(), self.signum)


def _fit(root: Path, max_steps: int, extra: list[L.Callback],
         ckpt: str | None = None) -> tuple[PolicyModule, StepLosses]:
    module = PolicyModule(trace=TraceConfig(audit_every=2),
                          rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
                          warmup_steps=2, cpu_threads=1)
    losses = StepLosses()
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, default_root_dir=root, logger=False,
                        callbacks=[*default_callbacks(), losses, *extra], plugins=[AtomicCheckpointIO()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8), ckpt_path=ckpt)
    return module, losses


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_exits_non_zero_and_resume_is_exact(tmp_path: Path, signum: int) -> None:
    full, full_losses = _fit(tmp_path / "full", 5, [])
    before = signal.getsignal(signum)
    with pytest.raises(FitInterrupted) as stopped:
        _fit(tmp_path / "killed", 5, [SignalAtStep(2, signum), StopOnSignal()])
    assert stopped.value.code == 128 + signum
    ckpt = tmp_path / "killed" / "checkpoints" / "interrupted.ckpt"
    assert stopped.value.checkpoint == str(ckpt)
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    assert signal.getsignal(signum) == before  # the callback's handler is gone again
    resumed, resumed_losses = _fit(tmp_path / "resumed", 5, [StopOnSignal()], ckpt=str(ckpt))
    assert sorted(resumed_losses.steps) == [3, 4]
    for step in (3, 4):
        assert resumed_losses.steps[step] == full_losses.steps[step], step  # exactly, not approximately
    for key, value in full.policy.state_dict().items():
        torch.testing.assert_close(resumed.policy.state_dict()[key], value, rtol=0, atol=0)


class SignalDuringValidation(L.Callback):
    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def _validating_fit(root: Path, extra: list[L.Callback], ckpt: str | None = None) -> tuple[PolicyModule, StepLosses]:
    """4 steps (1 warm-up) with a validation pass after steps 2 and 4."""
    module = PolicyModule(rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=2),
                          warmup_steps=1, cpu_threads=1)
    losses = StepLosses()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, default_root_dir=root, logger=False,
                        callbacks=[*default_callbacks(), losses, *extra, StopOnSignal()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=4, eval_size=4), ckpt_path=ckpt)
    return module, losses


def test_sigterm_during_validation_saves_after_it_and_resumes(tmp_path: Path) -> None:
    with pytest.raises(FitInterrupted) as stopped:
        _validating_fit(tmp_path / "killed", [SignalDuringValidation()])
    assert stopped.value.code == 143
    state = torch.load(stopped.value.checkpoint, weights_only=False)
    assert state["global_step"] == 2 and state["policy_version"] == 2
    resumed, losses = _validating_fit(tmp_path / "resumed", [], ckpt=stopped.value.checkpoint)
    assert resumed.policy_version == 4 and sorted(losses.steps) == [2, 3]


def test_fit_without_a_signal_runs_to_the_end(tmp_path: Path) -> None:
    module, losses = _fit(tmp_path, 3, [StopOnSignal()])
    assert sorted(losses.steps) == [2] and module.policy_version == 3
    assert not (tmp_path / "checkpoints" / "interrupted.ckpt").exists()


def test_atomic_save_keeps_the_old_file_when_the_write_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, target)

    def torn_save(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_torch_save({"step": 2}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left behind


def test_checkpoint_io_stages_beside_the_target_not_in_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR on another filesystem made Lightning's move a copy that a SIGKILL could tear."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renames.append((str(src), str(dst))), real_replace(src, dst)))
    target = tmp_path / "ckpts" / "step=3.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, target)
    assert len(renames) == 1 and Path(renames[0][0]).parent == target.parent and renames[0][1] == str(target)
    assert AtomicCheckpointIO().load_checkpoint(target)["global_step"] == 3
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint({}, target, storage_options={"x": 1})


@pytest.mark.slow  # a whole run or many processes: CI runs it in its slow pass
@pytest.mark.parametrize("problem_workers", [0, 2], ids=["in-process", "loader-workers-group-signalled"])
def test_trace_rl_fit_killed_by_sigterm_exits_143_with_a_resumable_checkpoint(tmp_path: Path,
                                                                              problem_workers: int) -> None:
    """The shipped config: periodic last.ckpt, and SIGTERM mid-fit leaves interrupted.ckpt and status 143. With
    loader workers the signal goes to the whole process group (as a scheduler or a Ctrl-C sends it): the workers
    leave it to the trainer, and none outlives it."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "trace_lightning.lit.cli", "fit", "--config", str(CONF), "--trainer.max_steps", "400",
           "--model.warmup_steps", "400", "--trainer.logger.init_args.save_dir", str(runs),
           "--trainer.enable_progress_bar", "false", "--data.problem_workers", str(problem_workers)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    last = runs / "trace_compact-arithmetic-debug-moe" / "version_0" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if problem_workers:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if problem_workers:
        time.sleep(1)
        with pytest.raises(ProcessLookupError):  # the process group is empty: no worker left behind
            os.killpg(proc.pid, 0)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    interrupted = last.with_name("interrupted.ckpt")
    assert interrupted.exists(), err[-2000:]
    assert "resume with --ckpt_path" in err
    state = torch.load(interrupted, weights_only=False)
    assert state["global_step"] >= 1 and "policy_version" in state
    assert not list(last.parent.glob(".*.tmp"))


WRITER = """
import sys, torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from trace_lightning.lit.signals import AtomicCheckpointIO
io = AtomicCheckpointIO() if sys.argv[2] == "atomic" else TorchCheckpointIO()
state = {"weights": torch.randn(1_000_000)}
for n in range(100_000):
    state["step"] = n
    io.save_checkpoint(state, sys.argv[1])
    print(n, flush=True)
"""


def kill_writes(target: Path, writer: str, kills: int) -> int:
    """SIGKILL a process rewriting `target` in a loop `kills` times; returns how often `target` was left torn."""
    shm = Path("/dev/shm")
    other_fs = shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != target.parent.stat().st_dev
    env = {**os.environ, "TMPDIR": str(shm if other_fs else target.parent.parent)}
    torn = 0
    for kill in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), writer], stdout=subprocess.PIPE,
                                text=True, env=env)
        assert proc.stdout is not None
        for _ in range(2 + kill % 3):  # let it finish a few writes, then kill it during another
            proc.stdout.readline()
        time.sleep(0.002 * kill)
        proc.kill()
        proc.wait(timeout=60)
        try:
            torch.load(target, weights_only=True)
        except Exception:  # noqa: BLE001 (any failure to load is a torn file)
            torn += 1
    return torn


@pytest.mark.slow  # a whole run or many processes: CI runs it in its slow pass
def test_sigkill_during_checkpoint_writes_never_leaves_a_torn_file(tmp_path: Path) -> None:
    """4 MB checkpoints rewritten in a loop with TMPDIR on another filesystem (/dev/shm when it is one), SIGKILL
    at varying moments: the file under the final name always loads (the previous or the next checkpoint)."""
    target = tmp_path / "ckpts" / "last.ckpt"
    target.parent.mkdir()
    assert kill_writes(target, "atomic", kills=4) == 0
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.startswith(".")) == ["last.ckpt"]
