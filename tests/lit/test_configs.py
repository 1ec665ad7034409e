"""Every shipped YAML config parses, and a bad key or type gives the CLI's clear error."""

from pathlib import Path

import pytest
from jsonargparse import ArgumentError

from trace_lightning.lit.cli import main

CONF = Path(__file__).resolve().parents[2] / "conf"
METHOD_PRESETS = sorted((CONF / "method").glob("*.yaml"))


def _parse(*configs: Path, extra: tuple[str, ...] = ()) -> object:
    args: list[str] = []
    for c in configs:
        args += ["--config", str(c)]
    return main([*args, *extra], run=False)


def test_sim_config_parses_into_the_default_method() -> None:
    cli = _parse(CONF / "sim.yaml")
    assert cli.model.method.name == "trace_compact"
    assert cli.model.policy.config.name == "debug-moe"
    assert cli.trainer.max_steps == 400


@pytest.mark.parametrize("preset", METHOD_PRESETS, ids=lambda p: p.stem)
def test_method_presets_stack_on_sim(preset: Path) -> None:
    cli = _parse(CONF / "sim.yaml", preset)
    expected = preset.stem if preset.stem != "route_replay" else "trace_compact"
    assert cli.model.method.name == expected


def test_bad_key_is_a_clear_cli_error() -> None:
    with pytest.raises(ArgumentError, match="no_such_key"):
        _parse(CONF / "sim.yaml", extra=("--model.trace.no_such_key", "1"))


def test_bad_type_is_a_clear_cli_error() -> None:
    with pytest.raises(ArgumentError, match="group_size"):
        _parse(CONF / "sim.yaml", extra=("--model.rollout.group_size", "many"))


def test_unknown_method_names_the_choices() -> None:
    with pytest.raises(ValueError, match="trace.method"):
        _parse(CONF / "sim.yaml", extra=("--model.trace.method", "fp3"))


@pytest.mark.parametrize("preset", sorted((CONF / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_presets_parse(preset: Path) -> None:
    # Parse only: building a 190M-parameter model is not what this test is about.
    cli = _parse(CONF / "sim.yaml")
    namespace = cli.parser.parse_args(["--config", str(CONF / "sim.yaml"), "--config", str(preset)])
    assert namespace.model.cpu_threads == 0


@pytest.mark.parametrize(("task", "env"), [("coding", "coding"), ("multiturn", "guess_number"),
                                           ("calculator", "calculator")])
def test_task_configs_stack_on_sim_and_build_their_env(task: str, env: str) -> None:
    from trace_lightning.envs import ENVS

    cli = _parse(CONF / "sim.yaml", CONF / "task" / f"{task}.yaml")
    assert isinstance(cli.datamodule.env, ENVS[env])
    problem = cli.datamodule.env.sample(1, seed=0)[0]
    assert cli.datamodule.env.score(problem, cli.datamodule.env.demonstration(problem)) == 1.0
