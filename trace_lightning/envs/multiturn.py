"""Multi-turn tasks: the policy acts, the env answers, until the episode ends.

Protocol (on top of Env): a policy turn ends where its text ends with `turn_stop` (or at `max_turn_tokens`
tokens, or at a stop token); `reply(problem, turns) -> Reply` answers the last of the policy's turns so far. It is a
pure function of the turns (the env replays them), so the rollout can ask it from worker threads, for many episodes
at once, with no episode state to share. The rollout builds the sequence as

    prompt + turn_1 + reply_1 + turn_2 + reply_2 + ... + turn_n

(the reply that ends the episode is not appended: nothing is sampled after it) and trains only on the policy's
turns: the replies' tokens are prompt-like, masked out of the loss and of the mismatch metrics
(trace_lightning/rollout/turns.py). The episode's reward is its last reply's. `run_episode` drives the same loop
for any policy callable (tests and demos), and `score` replays a whole transcript, so
`score(problem, demonstration(problem)) == 1` as for every Env.

Guess the number: the prompt is "guess 1-15:\\n"; each turn is a number and a space ("8 "); the env replies
"higher\\n" (the secret is larger), "lower\\n", "correct\\n" (reward 1, done) or "invalid\\n" for a turn that does
not start with a number. After max_turns guesses without success the episode ends with reward 0.
Bisection needs ceil(log2(15 + 1)) = 4 turns: "8 lower\\n4 higher\\n6 higher\\n7 correct\\n" for secret 7.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from trace_lightning.envs.base import Env, Problem, register_env


@dataclass(frozen=True)
class Reply:
    """The env's answer to a policy turn: the text appended to the conversation, whether the episode is over, and
    its reward (counted when done)."""

    text: str
    done: bool
    reward: float = 0.0


@runtime_checkable
class MultiTurnEnv(Env, Protocol):
    """An Env whose episodes alternate policy turns and env replies."""

    turn_stop: str
    """A policy turn ends where its text ends with this."""
    max_turn_tokens: int
    """A policy turn that has not stopped by this many tokens ends there."""
    max_turns: int
    """Episodes end after this many policy turns (the env says done at the last)."""

    def reply(self, problem: Problem, turns: Sequence[str]) -> Reply:
        """The env's reply to turns[-1], having seen turns[:-1] (a pure function of problem and turns)."""
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
        """Everything after the prompt: turn_1 + reply_1 + turn_2 + ..."""
        return "".join(t + o for t, o in zip(self.turns, self.observations, strict=True))


def run_episode(env: MultiTurnEnv, problem: Problem, policy: Callable[[str], str], max_steps: int = 64) -> Episode:
    """Play problem with policy (context text -> next turn) until done or max_steps."""
    episode = Episode()
    context = problem.prompt
    while not episode.done and len(episode.turns) < max_steps:
        turn = policy(context)
        episode.turns.append(turn)
        reply = env.reply(problem, episode.turns)
        episode.observations.append(reply.text)
        episode.reward, episode.done = reply.reward, reply.done
        context += turn + reply.text
    return episode


class GuessNumberEnv:
    """Find a secret integer in [low, high] from higher / lower feedback."""

    turn_stop = " "

    def __init__(self, low: int = 1, high: int = 15, max_turns: int = 5) -> None:
        if high < low or max_turns < 1:
            raise ValueError(f"need low <= high and max_turns >= 1, got {low}, {high}, {max_turns}")
        self.low, self.high, self.max_turns = low, high, max_turns
        self.max_turn_tokens = len(str(high)) + 2  # a sign, the digits and the space

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        prompt = f"guess {self.low}-{self.high}:\n"
        return [Problem(prompt, str(s), {"secret": s}) for s in (rng.randint(self.low, self.high) for _ in range(n))]

    def reply(self, problem: Problem, turns: Sequence[str]) -> Reply:
        if not turns:
            raise ValueError("reply() needs at least one policy turn")
        if len(turns) > self.max_turns:
            raise ValueError(f"{len(turns)} turns exceed max_turns {self.max_turns}")
        secret = int(problem.metadata["secret"])
        if any(self._guess(t) == secret for t in turns[:-1]):
            raise ValueError("reply() after the episode ended (an earlier turn guessed the secret)")
        guess = self._guess(turns[-1])
        if guess == secret:
            return Reply("correct\n", True, 1.0)
        done = len(turns) >= self.max_turns
        if guess is None:
            return Reply("invalid\n", done)
        return Reply("higher\n" if secret > guess else "lower\n", done)

    @staticmethod
    def _guess(turn: str) -> int | None:
        match = re.match(r"[+-]?\d+", turn.strip())
        return int(match.group(0)) if match else None

    def score(self, problem: Problem, response: str) -> float:
        """Replay a transcript: each line's leading number is one turn (the env's replies are ignored)."""
        turns: list[str] = []
        for line in response.splitlines()[: self.max_turns]:
            turns.append(line)
            if self.reply(problem, turns).done:
                return self.reply(problem, turns).reward
        return 0.0

    def bisection_turns(self, problem: Problem) -> list[str]:
        """The optimal policy's turns (what demonstration() interleaves with the env's replies)."""
        secret, low, high, turns = int(problem.metadata["secret"]), self.low, self.high, []
        while True:
            guess = (low + high + 1) // 2
            turns.append(f"{guess}{self.turn_stop}")
            if guess == secret:
                return turns
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)

    def demonstration(self, problem: Problem) -> str:
        turns = iter(self.bisection_turns(problem))
        return run_episode(self, problem, lambda _context: next(turns)).transcript


register_env("guess_number")(GuessNumberEnv)
