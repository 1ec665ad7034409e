"""Model answers never run as code: reasoning-gym's evaluating verifiers behind envs/verifier_guard.py.

Correct answers still score as the verifier scores them (reasoning-gym's own answers, through our env, against its
own score_answer), hostile ones score 0 without side effects, and every evaluating verifier of the installed
reasoning-gym is listed (a new release adding one fails here)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from trace_lightning.envs import ReasoningGymEnv
from trace_lightning.envs.verifier_guard import (
    EXPRESSION_VERIFIERS,
    LIST_EVAL_VERIFIERS,
    UnsafeAnswer,
    check_expression,
)

TRUSTED = {
    "number_sorting": "evals its own reference answer, never the model's",
    "codeio": "execs its own generator code while building a problem",
}
EVALUATES = re.compile(r"(?<![\w.])eval\(|parse_expr\(|sympify\(|(?<![\w.])exec\(")


def test_every_evaluating_verifier_of_the_installed_reasoning_gym_is_guarded() -> None:
    evaluating = set()
    for name, (cls, _) in DATASETS.items():
        scorers = [c for c in cls.__mro__ if c.__module__.startswith("reasoning_gym") and "score_answer" in vars(c)]
        if any(EVALUATES.search(inspect.getsource(c)) for c in scorers):
            evaluating.add(name)
    assert EXPRESSION_VERIFIERS | LIST_EVAL_VERIFIERS <= evaluating  # each listed one really evaluates
    assert evaluating - EXPRESSION_VERIFIERS - LIST_EVAL_VERIFIERS == set(TRUSTED)


@pytest.mark.parametrize("dataset", sorted(EXPRESSION_VERIFIERS))
def test_correct_expression_answers_score_as_the_verifier_scores_them(dataset: str) -> None:
    env = ReasoningGymEnv(dataset, size=60, seed=3, prompt_format="native", answer_format="line", partial_credit=True,
                          max_answer_chars=1000)
    oracle = reasoning_gym.create_dataset(dataset, size=60, seed=3)
    for i in range(60):
        entry = oracle[i]
        answer = entry["answer"].split("\n")[0]
        check_expression(answer)
        assert env.score(env.problem(i), answer) == min(max(oracle.score_answer(answer, entry), 0.0), 1.0) > 0


@pytest.mark.parametrize("answer", [
    "9**9**9", "(10**10)**10", "2**(99999*99999)", "2**99999", "__import__('os').system('true')",
    "().__class__.__bases__", "x.__class__", "[1][0]", "lambda: 1", "open('f')", "exp(x, evaluate=False)",
    "'a'*10", "1 if x else 2", "x < 1", "5!", "x^2", "f(*y)", "_x + 1", "1" * 1001,
])
def test_hostile_or_runaway_expressions_are_refused(answer: str) -> None:
    with pytest.raises(UnsafeAnswer):
        check_expression(answer)


@pytest.mark.parametrize("answer", ["-4*(-2*x - 8)**(3/2)/3 + C", "x**3/3 + exp(2*x)/2 - log(x) + C", "94*4 - 61 - 6",
                                    "-(3*Integral(x**3*cos(3*x), x)) + C", "10*(8 - 5) - 6", "x**-2 + 2.5e3 % 7 // 2"])
def test_arithmetic_expressions_pass(answer: str) -> None:
    check_expression(answer)


@pytest.mark.parametrize("dataset", sorted(EXPRESSION_VERIFIERS | LIST_EVAL_VERIFIERS))
def test_code_in_an_answer_never_runs(dataset: str, tmp_path: Path) -> None:
    """Each evaluating verifier, through the env, with answers that would create a folder if evaluated."""
    env = ReasoningGymEnv(dataset, size=5, seed=0, prompt_format="native", answer_format="line",
                          partial_credit=True, max_answer_chars=200)
    problem = env.problem(0)
    for i, payload in enumerate(["__import__('os').mkdir({!r})", "[__import__('os').mkdir({!r})]",
                                 "1+__import__('os').mkdir({!r})"]):
        target = tmp_path / f"ran{i}"
        assert env.score(problem, payload.format(str(target))) == 0.0
        assert not target.exists(), f"{dataset} ran the answer's code"


def test_list_verifiers_still_read_a_written_list() -> None:
    """The eval fallback of the list verifiers (partial credit for the right list in Python syntax) still works, on
    literals."""
    env = ReasoningGymEnv("spiral_matrix", size=5, seed=0, prompt_format="native", answer_format="line",
                          partial_credit=True, max_answer_chars=400)
    problem = env.problem(0)
    as_list = "[" + ", ".join(problem.answer.split()) + "]"
    assert env.score(problem, problem.answer) == 1.0 and env.score(problem, as_list) == pytest.approx(0.1)
