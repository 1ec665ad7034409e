"""The Env protocol every task implements, and the registry that builds tasks by name.

An Env is a stateless task description: it samples problems reproducibly from a seed, scores a response
with a verifier (reward in [0, 1]), and can produce a demonstration (the target response) for a
supervised warm start. Multi-turn tasks add `reply` (see multiturn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Problem:
    """One task instance: the prompt text, the reference answer, and whatever the verifier needs."""

    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A verifiable task."""

    def sample(self, n: int, seed: int) -> list[Problem]:
        """n problems, the same ones for the same seed."""
        ...

    def score(self, problem: Problem, response: str) -> float:
        """Reward in [0, 1] for the policy's response (the text generated after the prompt)."""
        ...

    def demonstration(self, problem: Problem) -> str:
        """The target response text for this problem; score(problem, demonstration(problem)) == 1."""
        ...


ENVS: dict[str, Callable[..., Env]] = {}


def register_env(name: str) -> Callable[[Callable[..., Env]], Callable[..., Env]]:
    """Decorator adding a factory (a class or a function returning an Env) to ENVS under name."""

    def add(factory: Callable[..., Env]) -> Callable[..., Env]:
        if name in ENVS:
            raise ValueError(f"env {name!r} is already registered")
        ENVS[name] = factory
        return factory

    return add


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the env registered as name with kwargs; ValueError listing the known names otherwise."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name](**kwargs)
