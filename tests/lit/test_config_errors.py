"""Bad settings stop the run at construction, before the warm start, with one line that names the field."""

import math
import warnings
from pathlib import Path

import pytest

from trace_lightning.envs import ENVS
from trace_lightning.lit.cli import main
from trace_lightning.lit.config import NoLearningSignalWarning, RLConfig, RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.methods import METHODS, get_method
from trace_lightning.model import MoEConfig
from trace_lightning.model.config import name_to_config
from trace_lightning.rl import ADVANTAGES

CONF = Path(__file__).resolve().parents[2] / "conf"


def _one_line_listing(err: pytest.ExceptionInfo[ValueError], field: str, choices: list[str]) -> None:
    message = str(err.value)
    assert "\n" not in message and field in message, message
    assert all(c in message for c in choices), message


@pytest.mark.parametrize(
    ("build", "field", "choices"),
    [
        (lambda: TraceConfig(method="fp3"), "trace.method", sorted(METHODS)),
        (lambda: get_method("fp3"), "trace.method", sorted(METHODS)),
        (lambda: TraceConfig(fmt="fp8"), "trace.fmt", ["nvfp4", "mxfp4", "mxfp4:rceil"]),
        (lambda: TraceConfig(backend="cuda"), "trace.backend", ["auto", "triton", "sim"]),
        (lambda: TraceConfig(rollout_compute="fp16"), "trace.rollout_compute", ["bf16", "fp32"]),
        (lambda: TraceConfig(layers="last:x"), "trace.layers", ["last:K", "budget:B"]),
        (lambda: RLConfig(advantage="ppo"), "rl.advantage", sorted(ADVANTAGES)),
        (lambda: RLConfig(loss="dpo"), "rl.loss", ["ppo_clip", "gspo", "pg"]),
        (lambda: RLConfig(loss_agg="sum"), "rl.loss_agg", ["token_mean"]),
        (lambda: RLConfig(correction="is"), "rl.correction", ["none", "tis", "mis", "icepop"]),
        (lambda: RLDataModule(env="chess"), "env", sorted(ENVS)),
        (lambda: MoEConfig.from_name("gpt-5"), "model preset", sorted(name_to_config)),
    ],
    ids=["method", "get_method", "fmt", "backend", "compute", "layers", "advantage", "loss", "loss_agg",
         "correction", "env", "preset"],
)
def test_a_bad_name_is_one_line_listing_the_choices(build, field: str, choices: list[str]) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as err:
        build()
    _one_line_listing(err, field, choices)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_size": 0}, "rollout.group_size must be an integer >= 1, got 0"),
        ({"group_size": -3}, "rollout.group_size must be an integer >= 1, got -3"),
        ({"prompts_per_step": 0}, "rollout.prompts_per_step must be an integer >= 1, got 0"),
        ({"max_new_tokens": 2.5}, "rollout.max_new_tokens must be an integer >= 1, got 2.5"),
        ({"group_size": True}, "rollout.group_size must be an integer >= 1, got True"),
        ({"temperature": math.nan}, "rollout.temperature must be a finite number >= 0.0, got nan"),
        ({"temperature": -1.0}, "rollout.temperature must be a finite number >= 0.0, got -1.0"),
        ({"top_p": 0.0}, "rollout.top_p must be a finite number > 0.0 and <= 1.0, got 0.0"),
        ({"top_k": -1}, "rollout.top_k must be an integer >= 0, got -1"),
    ],
)
def test_bad_rollout_numbers_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        RolloutConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_eps": -0.1}, "rl.clip_eps must be a finite number >= 0.0, got -0.1"),
        ({"clip_eps": math.inf}, "rl.clip_eps must be a finite number >= 0.0, got inf"),
        ({"kl_coef": -1.0}, "rl.kl_coef must be a finite number >= 0.0, got -1.0"),
        ({"tis_cap": 0.0}, "rl.tis_cap must be a finite number > 0.0, got 0.0"),
        ({"icepop_bound": 1.0}, "rl.icepop_bound must be a finite number > 1.0, got 1.0"),
    ],
)
def test_bad_rl_numbers_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        RLConfig(**kwargs)
    assert str(err.value) == message


def test_policy_module_refuses_before_building_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks run before any weight exists (so before the warm start, which needs them)."""
    import trace_lightning.lit.policy as policy

    def no_build(*args: object) -> None:
        raise AssertionError("built the model before refusing the settings")

    monkeypatch.setattr(policy, "build_policy", no_build)
    for kwargs, field in (({"rollout": {"group_size": 0}}, "group_size"),
                          ({"rollout": {"prompts_per_step": 0}}, "prompts_per_step"),
                          ({"rl": {"clip_eps": -0.2}}, "clip_eps"),
                          ({"rl": {"advantage": "rloo"}, "rollout": {"group_size": 1}}, "group_size >= 2"),
                          ({"lr": -1e-3}, "lr"), ({"warmup_steps": -1}, "warmup_steps")):
        with warnings.catch_warnings(), pytest.raises(ValueError, match=field):
            warnings.simplefilter("ignore", NoLearningSignalWarning)
            PolicyModule(**kwargs)


@pytest.mark.parametrize(("kwargs", "what"), [({"group_size": 1}, "group_size is 1"),
                                              ({"temperature": 0.0}, "temperature is 0")])
def test_settings_without_a_learning_signal_warn(kwargs: dict, what: str) -> None:
    with pytest.warns(NoLearningSignalWarning, match=what):
        RolloutConfig(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoLearningSignalWarning)
        RolloutConfig()  # the defaults are silent


def test_cli_refuses_group_size_zero_before_running() -> None:
    with pytest.raises(ValueError, match=r"rollout.group_size must be an integer >= 1, got 0"):
        main(["--config", str(CONF / "sim.yaml"), "--model.rollout.group_size", "0"], run=False)
