"""Multi-turn tasks: the policy acts, the env answers, until the episode ends.

Protocol (on top of Env): `reset(problem) -> state` starts an episode, and
`step(state, response) -> (observation, reward, done)` consumes one policy turn, updates `state` in
place and returns the env's reply. The framework builds the context as

    prompt + turn_1 + observation_1 + turn_2 + observation_2 + ...

and trains only on the policy's turns (observation tokens are masked out of the loss). Rewards are 0 until
the last step. `run_episode` drives this loop for any policy callable (used by tests and the demos), and
`score` replays a whole transcript, so `score(problem, demonstration(problem)) == 1` as for every Env.

Guess the number: the prompt is "guess 1-15:\n"; each turn is a number; the env replies " higher\n"
(the secret is larger), " lower\n", " correct\n" (reward 1, done) or " invalid\n" for a turn that does not
start with a number. After max_turns guesses without success the episode ends with reward 0.
Bisection needs ceil(log2(15 + 1)) = 4 turns: "8 lower\n4 higher\n6 higher\n7 correct\n" for secret 7.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from trace_lightning.envs.base import Env, Problem, register_env


@runtime_checkable
class MultiTurnEnv(Env, Protocol):
    """An Env whose episodes alternate policy turns and env observations."""

    def reset(self, problem: Problem) -> Any:
        """A fresh episode state for problem."""
        ...

    def step(self, state: Any, response: str) -> tuple[str, float, bool]:
        """Apply one policy turn to state (in place); return (observation, reward, done)."""
        ...


@dataclass
class Episode:
    """A finished (or truncated) episode: the policy's turns, the env's replies and the final reward."""

    turns: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False

    @property
    def transcript(self) -> str:
        """Everything after the prompt: turn_1 + observation_1 + turn_2 + ..."""
        return "".join(t + o for t, o in zip(self.turns, self.observations, strict=True))


def run_episode(env: MultiTurnEnv, problem: Problem, policy: Callable[[str], str], max_steps: int = 64) -> Episode:
    """Play problem with policy (context text -> next turn) until done or max_steps."""
    state, episode = env.reset(problem), Episode()
    context = problem.prompt
    while not episode.done and len(episode.turns) < max_steps:
        turn = policy(context)
        observation, episode.reward, episode.done = env.step(state, turn)
        episode.turns.append(turn)
        episode.observations.append(observation)
        context += turn + observation
    return episode


@dataclass
class GuessState:
    """Where a guess-the-number episode stands."""

    secret: int
    turns: int = 0
    done: bool = False


class GuessNumberEnv:
    """Find a secret integer in [low, high] from higher / lower feedback."""

    def __init__(self, low: int = 1, high: int = 15, max_turns: int = 5) -> None:
        if high < low or max_turns < 1:
            raise ValueError(f"need low <= high and max_turns >= 1, got {low}, {high}, {max_turns}")
        self.low, self.high, self.max_turns = low, high, max_turns

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        prompt = f"guess {self.low}-{self.high}:\n"
        return [Problem(prompt, str(s), {"secret": s}) for s in (rng.randint(self.low, self.high) for _ in range(n))]

    def reset(self, problem: Problem) -> GuessState:
        return GuessState(secret=int(problem.metadata["secret"]))

    def step(self, state: GuessState, response: str) -> tuple[str, float, bool]:
        if state.done:
            raise ValueError("step() on a finished episode")
        state.turns += 1
        match = re.match(r"[+-]?\d+", response.strip())
        guess = int(match.group(0)) if match else None
        if guess == state.secret:
            state.done = True
            return " correct\n", 1.0, True
        state.done = state.turns >= self.max_turns
        if guess is None:
            return " invalid\n", 0.0, state.done
        return (" higher\n" if state.secret > guess else " lower\n"), 0.0, state.done

    def score(self, problem: Problem, response: str) -> float:
        """Replay a transcript: each line's leading number is one turn (the env's replies are ignored)."""
        state, reward = self.reset(problem), 0.0
        for line in response.splitlines():
            if state.done:
                break
            _, reward, _ = self.step(state, line)
        return reward

    def bisection_turns(self, problem: Problem) -> list[str]:
        """The optimal policy's turns (what demonstration() interleaves with the env's replies)."""
        secret, low, high, turns = int(problem.metadata["secret"]), self.low, self.high, []
        while True:
            guess = (low + high + 1) // 2
            turns.append(str(guess))
            if guess == secret:
                return turns
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)

    def demonstration(self, problem: Problem) -> str:
        turns = iter(self.bisection_turns(problem))
        return run_episode(self, problem, lambda _context: next(turns)).transcript


register_env("guess_number")(GuessNumberEnv)
