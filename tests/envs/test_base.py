"""The env registry."""

import pytest

from trace_lightning.envs import ENVS, Env, Problem, make_env, register_env


def test_known_envs_are_registered_and_satisfy_protocol() -> None:
    assert {"arithmetic", "chain_sum", "countdown", "reasoning_gym", "coding", "guess_number"} <= set(ENVS)
    for name in ("arithmetic", "guess_number"):
        assert isinstance(make_env(name), Env)
    assert isinstance(make_env("coding", isolation="none"), Env)  # the protocol only (bwrap: test_coding.py)


def test_unknown_env_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown env 'chess'; known: \[.*'arithmetic'.*'guess_number'"):
        make_env("chess")


def test_duplicate_registration_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_env("arithmetic")(lambda: None)


def test_problem_metadata_defaults_empty() -> None:
    assert Problem("1+1=", "2").metadata == {}
