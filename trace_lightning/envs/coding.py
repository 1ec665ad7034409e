"""A small program-synthesis task: infer a Python function from input/output examples.

Prompt (short enough for the character-level sim policy, <= 128 chars):

    f(3)=9;f(0)=3;f(-2)=-1
    f=lambda x:

The response is either the lambda's body on one line (" 2*x+3"; only the first line is used), or a full
definition starting with "def f(x):". The verifier runs it in the sandbox (sandbox.py) on the shown
examples plus hidden inputs, compares each result with the expected value (same type, same value) in the
parent, and gives 1.0 only when every test passes, else 0.0. Code that loops, allocates without bound,
imports, opens files, spawns processes or touches the network fails its tests and gets 0; score never raises.

The env refuses to start when bubblewrap is unusable, unless isolation="none" is passed explicitly, and,
for a root trainer, when the sandbox cannot drop to uid 65534, unless allow_root=True is passed.

Task families are tiny on purpose (affine maps, string and list one-liners); the shown examples are
resampled until no other task of the same input type fits them all, so the examples identify the task.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trace_lightning.envs.base import Problem, register_env
from trace_lightning.envs.isolation import require_isolation
from trace_lightning.envs.sandbox import run_sandboxed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """One target function: its input type and the canonical expression in x."""

    kind: str
    expr: str

    def __call__(self, x: Any) -> Any:
        return eval(f"lambda x: {self.expr}")(x)  # our own fixed expressions, never model output


def _tasks() -> list[Task]:
    ints = [Task("int", f"{a}*x+{b}" if b else f"{a}*x") for a in (2, 3, 4, 5) for b in range(10)]
    ints += [Task("int", f"x+{b}") for b in range(1, 10)]
    ints += [Task("int", f"x*x+{b}" if b else "x*x") for b in range(6)]
    ints += [Task("int", f"x%{k}") for k in (2, 3, 5)]
    strs = [Task("str", e) for e in ("x[::-1]", "x.upper()", "x*2", "x[0]", "x[-1]", "len(x)")]
    lists = [Task("list", e) for e in ("sum(x)", "max(x)", "min(x)", "sorted(x)", "len(x)", "x[::-1]")]
    lists += [Task("list", "[v*2 for v in x]")]
    return ints + strs + lists


TASKS: tuple[Task, ...] = tuple(_tasks())

INPUTS: dict[str, Callable[[random.Random], Any]] = {
    "int": lambda rng: rng.randint(-5, 12),
    "str": lambda rng: "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 4))),
    "list": lambda rng: [rng.randint(0, 9) for _ in range(rng.randint(2, 4))],
}


def _compact(value: Any) -> str:
    return repr(value).replace(", ", ",")


def _same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (so True is not 1 and (1,) is not [1])."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def program_from_response(response: str, max_chars: int = 2000) -> str | None:
    """Python source defining f, from a lambda body (first line) or a full `def f(...)`; None if empty."""
    text = response.strip()
    if not text or len(text) > max_chars:
        return None
    if text.startswith("def "):
        return text
    body = text.splitlines()[0].strip()
    return f"f = lambda x: ({body})" if body else None


class CodingEnv:
    """Infer-the-function tasks verified in a sandbox."""

    def __init__(
        self,
        kinds: tuple[str, ...] = ("int", "str", "list"),
        shown: int = 3,
        hidden: int = 5,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        isolation: str = "bwrap",
        allow_root: bool = False,
    ) -> None:
        """isolation: "bwrap" (namespaces + seccomp, the default; the env refuses to start without a working
        bwrap) or "none", the explicit opt-in to a weaker sandbox (rlimits and an audit hook only).
        allow_root: a root trainer's sandbox runs as uid 65534; where that cannot work the env refuses to
        start unless this is True (the code then runs as root outside its namespaces, without capabilities)."""
        unknown = set(kinds) - set(INPUTS)
        if unknown:
            raise ValueError(f"unknown input kinds {sorted(unknown)}; known: {sorted(INPUTS)}")
        require_isolation(isolation, allow_root)
        self.allow_root = allow_root
        self.kinds, self.shown, self.hidden = tuple(kinds), shown, hidden
        self.timeout_s, self.memory_mb, self.isolation = timeout_s, memory_mb, isolation

    def _examples(self, task: Task, rng: random.Random) -> list[Any]:
        rivals = [t for t in TASKS if t.kind == task.kind and t != task]
        for _ in range(50):
            xs = [INPUTS[task.kind](rng) for _ in range(self.shown)]
            if all(any(not _same(r(x), task(x)) for x in xs) for r in rivals):
                return xs
        return xs

    def make_problem(self, task: Task, rng: random.Random) -> Problem:
        xs = self._examples(task, rng)
        tests = xs + [INPUTS[task.kind](rng) for _ in range(self.hidden)]
        shown = ";".join(f"f({_compact(x)})={_compact(task(x))}" for x in xs)
        metadata = {"kind": task.kind, "tests": [[x] for x in tests], "expected": [task(x) for x in tests]}
        return Problem(prompt=f"{shown}\nf=lambda x:", answer=task.expr, metadata=metadata)

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        problems = []
        for _ in range(n):
            kind = rng.choice(self.kinds)
            problems.append(self.make_problem(rng.choice([t for t in TASKS if t.kind == kind]), rng))
        return problems

    def score(self, problem: Problem, response: str) -> float:
        """1.0 when the response passes every test, else 0.0; never raises (a reward must not end a fit)."""
        try:
            return self._score(problem, response)
        except Exception as e:  # the sandbox and the parser are built never to get here
            log.warning("coding score failed, counted as 0: %r", e)
            return 0.0

    def _score(self, problem: Problem, response: str) -> float:
        source = program_from_response(response)
        if source is None:
            return 0.0
        tests, expected = problem.metadata["tests"], problem.metadata["expected"]
        result = run_sandboxed(
            source, "f", [tuple(t) for t in tests], self.timeout_s, memory_mb=self.memory_mb, isolation=self.isolation,
            allow_root=self.allow_root,
        )
        if result.status != "ok" or len(result.outputs) != len(expected):
            return 0.0
        passed = all(
            tag == "ok" and _same(value, want) for (tag, value), want in zip(result.outputs, expected, strict=True)
        )
        return 1.0 if passed else 0.0

    def demonstration(self, problem: Problem) -> str:
        return problem.answer


register_env("coding")(CodingEnv)
