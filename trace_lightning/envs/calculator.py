"""A calculator tool task: the policy calls a calculator turn by turn, then states its answer.

The prompt asks for a*b+c ("what is 37*24+5?\\n"). Each policy turn is a line: "calc <expression>\\n" gets the
expression's value as the reply ("=888\\n"), "answer <integer>\\n" ends the episode ("correct\\n", reward 1, or
"wrong\\n"), anything else gets "invalid\\n". The demonstration uses the tool twice:
"calc 37*24\\n=888\\ncalc 888+5\\n=893\\nanswer 893\\ncorrect\\n".

The expression is evaluated by `evaluate`, a small recursive-descent parser of integer arithmetic (+ - * /,
parentheses, unary minus), never by Python's eval: the policy's text is data, not code. Its size and the size of
every intermediate value are bounded, so no reply costs more than a few microseconds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from trace_lightning.envs.base import Problem, register_env
from trace_lightning.envs.multiturn import Reply, run_episode

MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**12
"""Every literal and intermediate value stays within +-MAX_MAGNITUDE (an error otherwise)."""
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


class ExpressionError(ValueError):
    """The text is not an integer arithmetic expression the calculator evaluates."""


def evaluate(text: str) -> int:
    """The integer value of an arithmetic expression of integers, + - * /, parentheses and unary minus ("/" must
    divide exactly). ExpressionError names what is wrong."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens: list[str] = []
    for number, other in _TOKEN.findall(text.rstrip()):
        if other and other not in "+-*/()":
            raise ExpressionError(f"unexpected character {other!r}")
        tokens.append(number or other)
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[parser.pos]!r}")
    return value


class _Parser:
    """sum := product (('+' | '-') product)*; product := unary (('*' | '/') unary)*; unary := '-' unary | atom;
    atom := integer | '(' sum ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ExpressionError("the expression ends too early")
        self.pos += 1
        return token

    def sum(self) -> int:
        value = self.product()
        while self._peek() in ("+", "-"):
            value = _bounded(value + self.product() if self._take() == "+" else value - self.product())
        return value

    def product(self) -> int:
        value = self.unary()
        while self._peek() in ("*", "/"):
            if self._take() == "*":
                value = _bounded(value * self.unary())
                continue
            divisor = self.unary()
            if divisor == 0:
                raise ExpressionError("division by zero")
            if value % divisor:
                raise ExpressionError(f"{value}/{divisor} is not an integer")
            value //= divisor
        return value

    def unary(self) -> int:
        if self._peek() == "-":
            self._take()
            return -self.unary()
        return self.atom()

    def atom(self) -> int:
        token = self._take()
        if token == "(":
            self.depth += 1
            if self.depth > 16:
                raise ExpressionError("parentheses nested deeper than 16")
            value = self.sum()
            if self._peek() != ")":
                raise ExpressionError("missing ')'")
            self._take()
            self.depth -= 1
            return value
        if not token.isdigit():
            raise ExpressionError(f"expected a number, got {token!r}")
        return _bounded(int(token))


def _bounded(value: int) -> int:
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"a value exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return value


class CalculatorEnv:
    """Compute a*b+c with a calculator tool: "calc <expr>\\n" turns, then "answer <n>\\n"."""

    turn_stop = "\n"

    def __init__(self, low: int = 10, high: int = 99, max_turns: int = 4, max_turn_tokens: int = 16) -> None:
        if not 0 <= low <= high or max_turns < 1 or max_turn_tokens < 1:
            raise ValueError(f"need 0 <= low <= high, max_turns >= 1 and max_turn_tokens >= 1, got {low}, {high}, "
                             f"{max_turns}, {max_turn_tokens}")
        self.low, self.high, self.max_turns, self.max_turn_tokens = low, high, max_turns, max_turn_tokens

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng, out = random.Random(seed), []
        for _ in range(n):
            a, b, c = (rng.randint(self.low, self.high) for _ in range(3))
            out.append(Problem(f"what is {a}*{b}+{c}?\n", str(a * b + c), {"a": a, "b": b, "c": c}))
        return out

    def reply(self, problem: Problem, turns: Sequence[str]) -> Reply:
        if not turns:
            raise ValueError("reply() needs at least one policy turn")
        if len(turns) > self.max_turns:
            raise ValueError(f"{len(turns)} turns exceed max_turns {self.max_turns}")
        if any(t.strip().startswith("answer") for t in turns[:-1]):
            raise ValueError("reply() after the episode ended (an earlier turn answered)")
        turn, last = turns[-1].strip(), len(turns) >= self.max_turns
        if turn.startswith("answer"):
            correct = turn.removeprefix("answer").strip() == problem.answer
            return Reply("correct\n" if correct else "wrong\n", True, 1.0 if correct else 0.0)
        if turn.startswith("calc"):
            try:
                return Reply(f"={evaluate(turn.removeprefix('calc'))}\n", last)
            except ExpressionError as e:
                return Reply(f"error: {e}\n", last)
        return Reply("invalid\n", last)

    def score(self, problem: Problem, response: str) -> float:
        """Replay a transcript: the policy's lines are those starting with "calc" or "answer"."""
        turns = [line for line in response.splitlines() if line.strip().startswith(("calc", "answer"))]
        for i in range(1, min(len(turns), self.max_turns) + 1):
            reply = self.reply(problem, turns[:i])
            if reply.done:
                return reply.reward
        return 0.0

    def demonstration(self, problem: Problem) -> str:
        a, b, c = (int(problem.metadata[k]) for k in "abc")
        turns = iter([f"calc {a}*{b}\n", f"calc {a * b}+{c}\n", f"answer {a * b + c}\n"])
        return run_episode(self, problem, lambda _context: next(turns)).transcript


register_env("calculator")(CalculatorEnv)
