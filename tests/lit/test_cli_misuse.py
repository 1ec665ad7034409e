"""Command-line misuse ends in one line naming what is wrong (exit status 2), never a raw traceback; and settings given
beside a checkpoint either apply or are refused, never silently dropped."""

import sys
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from trace_lightning.lit.checkpoints import (
    CheckpointFileError,
    check_fits,
    expected_shapes,
    policy_weights,
    read_checkpoint,
)
from trace_lightning.lit.cli import TraceCLI, entry, main
from trace_lightning.lit.cli_checks import CLIError, check_group_values, drop_checkpoint_callbacks
from trace_lightning.lit.policy import PolicyModule, load_policy_weights

from .conftest import one_step_checkpoint

CONF = str(Path(__file__).resolve().parents[2] / "conf" / "sim.yaml")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A real one-step trace-rl checkpoint, and the wrong things a user may pass instead of one."""
    out = tmp_path_factory.mktemp("ckpts")
    module = one_step_checkpoint(out / "run.ckpt", weights_only=True)
    (out / "run_weights_only.ckpt").rename(out / "weights_only.ckpt")
    torch.save(module.policy.state_dict(), out / "bare.pt")
    (out / "garbage.ckpt").write_bytes(bytes(range(256)) * 8)
    ckpt = torch.load(out / "run.ckpt", weights_only=True)
    foreign = {**ckpt, "state_dict": {"net.weight": torch.zeros(3)}}
    foreign.pop("hyper_parameters")
    torch.save(foreign, out / "foreign.ckpt")
    ckpt["hyper_parameters"]["model"] = "small-moe"  # debug-moe weights labelled as another preset
    torch.save(ckpt, out / "relabelled.ckpt")
    (out / "folder.ckpt").mkdir()
    return {p.stem: str(p) for p in out.iterdir()} | {"missing": str(out / "missing.ckpt")}


def _misuse(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setattr(sys, "argv", ["trace-rl", *args])
    with pytest.raises(SystemExit) as exit_info:
        entry()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line or line.startswith("(")]
    assert "Traceback" not in err and len(lines) <= 2, err
    return lines[0]


@pytest.mark.parametrize(("name", "resume", "expected"), [
    ("missing", False, "no such file"),
    ("folder", False, "not a file"),
    ("garbage", False, "not a trace-rl checkpoint (not a torch zip archive"),
    ("bare", False, "a bare weights file, not a trace-rl checkpoint"),
    ("foreign", False, "holds no policy weights ('policy.*' keys in its state_dict): a checkpoint of another model"),
    ("weights_only", True, "cannot resume from it; start a new run from its weights with --model.init_from"),
])
def test_a_bad_checkpoint_file_is_named_with_what_it_is_not(name: str, resume: bool, expected: str,
                                                           files: dict[str, str]) -> None:
    with pytest.raises(CheckpointFileError) as err:
        read_checkpoint(files[name], "--ckpt_path", lightning=True, resume=resume)
    assert str(err.value).startswith(f"--ckpt_path {files[name]}: ") and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_good_checkpoints_read_and_fit_their_model(files: dict[str, str]) -> None:
    ckpt = read_checkpoint(files["run"], "--ckpt_path", resume=True)
    check_fits(policy_weights(ckpt), expected_shapes("debug-moe", None), "x", "debug-moe")
    read_checkpoint(files["weights_only"], "--ckpt_path")  # validate / predict need no optimizer state


def test_a_checkpoint_of_another_model_names_a_tensor(files: dict[str, str]) -> None:
    weights = policy_weights(read_checkpoint(files["run"], "--model.init_from"))
    with pytest.raises(CheckpointFileError) as err:
        check_fits(weights, expected_shapes("small-moe", None), "--model.init_from run.ckpt", "small-moe")
    assert str(err.value).startswith("--model.init_from run.ckpt: a checkpoint of another model, its weights do not "
                                     "fit small-moe: 36 missing (e.g. 'layers.4.attention_norm.weight'); "
                                     "'tok_embeddings.weight' is (128, 128), the model's is (32768, 512)")
    policy = PolicyModule(model="debug-moe", cpu_threads=1).policy
    del policy.layers[-1]  # one layer fewer, same widths: every tensor of the last layer is unexpected
    with pytest.raises(CheckpointFileError, match=r"--model.init_from .*run.ckpt: .* 9 unexpected \(e.g. 'layers.3."):
        load_policy_weights(policy, files["run"])


@pytest.mark.parametrize(("sub", "flag", "name", "expected"), [
    ("predict", "--ckpt_path", "garbage", "not a trace-rl checkpoint (not a torch zip archive"),
    ("fit", "--model.init_from", "missing", "no such file"),
])
def test_the_cli_prints_a_bad_checkpoint_as_one_line(sub: str, flag: str, name: str, expected: str,
                                                     files: dict[str, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    line = _misuse([sub, "--config", CONF, flag, files[name]], monkeypatch, capsys)
    assert line.startswith(f"trace-rl {sub}: error: {flag} {files[name]}") and expected in line, line


def test_relabelled_checkpoint_is_refused_by_the_cli(files: dict[str, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Its settings say small-moe, its weights are debug-moe's: the shapes are checked before Lightning loads it."""
    monkeypatch.chdir(tmp_path)
    line = _misuse(["validate", "--config", CONF, "--model.model", "small-moe", "--ckpt_path", files["relabelled"]],
                   monkeypatch, capsys)
    assert f"--ckpt_path {files['relabelled']}: a checkpoint of another model, its weights do not fit small-moe" \
        in line, line


@pytest.mark.parametrize(("args", "expected"), [
    (["--trainer.accelerator", "gpu"], "--trainer.accelerator gpu: torch sees no CUDA GPU"),
    (["--model.rollout", "5"], "--model.rollout takes a mapping of its settings, got '5'"),
    (["--trainer.precision", "bf16-mixed"], "--trainer.precision bf16-mixed: trace-rl keeps Lightning at 32-true"),
    (["--model.train_compute", "fp16"], "unknown train_compute 'fp16'"),
])
def test_a_bad_trainer_or_group_value_is_one_line(args: list[str], expected: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    if "gpu" in args and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    monkeypatch.chdir(tmp_path)
    line = _misuse(["fit", "--config", CONF, *args], monkeypatch, capsys)
    assert expected in line, line
    assert not (tmp_path / "runs").exists()  # refused before any logger made a run folder


def test_group_values_and_thread_counts_are_checked() -> None:
    with pytest.raises(CLIError, match=r"--model.trace takes a mapping of its settings, got 'fp4_qat': set one with "
                                       r"--model.trace.method VALUE"):
        check_group_values(["fit", "--model.trace=fp4_qat"])
    with pytest.raises(CLIError, match="--model.rl takes a mapping"):
        check_group_values(["--model.rl", "[1, 2]"])
    check_group_values(["--model.rollout", "{max_new_tokens: 5}", "--model.rollout.group_size", "2"])
    with pytest.raises(ValueError, match="cpu_threads must be an integer >= 0, got -2"):
        PolicyModule(cpu_threads=-2)


def test_checkpointing_off_drops_the_config_checkpoint_callback() -> None:
    cli = main(["--config", CONF, "--trainer.enable_checkpointing", "false"], run=False)
    assert cli.trainer.checkpoint_callback is None
    assert not any(type(cb).__name__ == "ModelCheckpoint" for cb in cli.trainer.callbacks)
    assert any(type(cb).__name__ == "StopOnSignal" for cb in cli.trainer.callbacks)  # kills still checkpoint
    kept = Namespace(enable_checkpointing=True, callbacks=[Namespace(class_path="x.ModelCheckpoint")])
    assert drop_checkpoint_callbacks(kept) == [] and len(kept.callbacks) == 1  # kept when checkpointing is on


@pytest.mark.parametrize(("sub", "args", "field"), [
    ("fit", ["--model.trace.method", "fp4_qat"], "model.trace.method 'trace_compact' but this command sets "
                                                 "'fp4_qat'"),
    ("predict", ["--model.model", "small-moe"], "model.model 'debug-moe' but this command sets 'small-moe'"),
    ("predict", ["--model.init_from", "x.ckpt"], "--model.init_from and --ckpt_path both given"),
])
def test_settings_that_redefine_a_checkpoint_are_refused(sub: str, args: list[str], field: str,
                                                        files: dict[str, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    line = _misuse([sub, "--config", CONF, "--ckpt_path", files["run"], *args], monkeypatch, capsys)
    assert field in line, line


def test_other_overrides_apply_over_the_checkpoint(files: dict[str, str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint was trained with max_new_tokens 2 and lr 1e-3: an explicit override wins, the rest is the
    run's, and the run's init_from is not loaded again."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TraceCLI, "_run_subcommand", lambda self, subcommand: None)
    cli = main(["predict", "--config", CONF, "--ckpt_path", files["run"], "--model.rollout.max_new_tokens", "7"])
    assert cli.model.rollout_cfg.max_new_tokens == 7
    assert cli.model.rollout_cfg.prompts_per_step == 2 and cli.model.hparams.warmup_steps == 1  # the checkpoint's
    assert cli.model.hparams.init_from is None
