"""Hostile answers on the scoring side: code through wrapped datasets, answers that stall a verifier, answers that
make the guard raise. None of this needs the coding sandbox (bubblewrap), so the file runs everywhere.

- Wrappers: every reasoning-gym class whose score_answer hands an entry to another dataset is seen through
  (verifier_guard.WRAPPERS, found by scanning reasoning-gym's source), and code in an answer to `composite` over
  each evaluating verifier never runs.
- Stalls and crashes: answers that keep sympy busy for minutes come back within the limit with reward 0 and a
  timeout counted, honest answers of the same batch still score, and the pool goes on scoring after its worker was
  killed; a verifier that sleeps, spins, exits, raises, returns NaN, allocates 4 GiB or writes a file costs its
  answer's reward and nothing else.
- Workers never re-run the trainer's main module (no main guard needed, no torch imported in each worker).
- Never raises: `admits`, `check_expression` (UnsafeAnswer only) and `score` on 3**1e999, deep nesting, long
  unary-minus chains, non-strings and malformed entries.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.dataset import ReseedingDataset

from trace_lightning.envs import Problem, ReasoningGymEnv, ScoringPool, make_env, score_responses
from trace_lightning.envs.verifier_guard import (
    EXPRESSION_VERIFIERS,
    LIST_EVAL_VERIFIERS,
    PURE_SCORERS,
    WRAPPERS,
    UnsafeAnswer,
    admits,
    check_expression,
    guard_list_verifiers,
    pure_scorer,
    scoring_chain,
    source_hash,
)

LIMIT_S = 1.0
SLACK_S = 2.0  # a replacement worker's fork and the kill on a loaded 2-core machine
EVALUATING = sorted(EXPRESSION_VERIFIERS | LIST_EVAL_VERIFIERS)
STALLING = {
    "countdown": "cos(exp(exp(exp(5))))",  # float() of it: sympy evaluates to ever higher precision, for minutes
    "puzzle24": "exp(999999999999)",  # int() of it: a number of 4e11 digits
}


def _tagged(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def _entry(problem: Problem) -> dict[str, Any]:
    md = problem.metadata
    return {"question": md["question"], "answer": md["rg_answer"], "metadata": md["rg_metadata"]}


@pytest.fixture(scope="module")
def composite() -> ReasoningGymEnv:
    """`composite` over every evaluating verifier, tagged answers of up to 400 characters."""
    env = ReasoningGymEnv("composite", size=60, seed=1, answer_format="tagged", max_answer_chars=400,
                          datasets=[DatasetSpec(name, 1.0, {}) for name in EVALUATING])
    yield env
    env.close()


def _hands_on(call: ast.Call) -> bool:
    """A call of another object's score_answer (not self's, not super()'s)."""
    func = call.func
    if not isinstance(func, ast.Attribute) or not func.attr.startswith("score_answer"):
        return False
    target = func.value
    return not (isinstance(target, ast.Name) and target.id == "self") and not (
        isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super")


def test_every_wrapper_in_reasoning_gym_is_seen_through() -> None:
    """Classes whose scoring calls another object's score_answer, found in reasoning-gym's source: each one the env
    can call (it defines score_answer) is in WRAPPERS; the rest score only through score_answer_with_id."""
    root = Path(reasoning_gym.__file__).parent
    delegating: dict[str, set[str]] = {}  # class -> its scoring methods that hand the entry on
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        if ".score_answer" not in source:
            continue
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("score_")):
                if any(_hands_on(call) for call in ast.walk(method) if isinstance(call, ast.Call)):
                    delegating.setdefault(f"{module}.{cls.name}", set()).add(method.name)
    callable_by_env = {cls for cls, methods in delegating.items() if "score_answer" in methods}
    assert callable_by_env == set(WRAPPERS)
    assert {"reasoning_gym.coaching.experiment.Experiment"} <= set(delegating) - callable_by_env


def test_composite_entries_resolve_to_the_part_that_scores_them(composite: ReasoningGymEnv) -> None:
    seen = set()
    for i in range(composite.size):
        entry = _entry(composite.problem(i))
        source = entry["metadata"]["source_dataset"]
        chain = scoring_chain(composite.data, entry)
        assert chain[0] is composite.data and chain[-1] is composite.data.datasets[source] and len(chain) == 2
        wrapped = scoring_chain(ReseedingDataset(composite.data), entry)  # a wrapper around the wrapper
        assert wrapped[1:] == chain
        seen.add(source)
    assert seen == set(EVALUATING)


def test_code_in_an_answer_to_composite_never_runs(composite: ReasoningGymEnv, tmp_path: Path) -> None:
    """Before the guard saw through composite, the first payload created its folder (countdown, spiral_matrix ...)."""
    payloads = ["__import__('os').makedirs({!r})", "[__import__('os').makedirs({!r})]",
                "1+__import__('os').makedirs({!r})"]
    problems, responses, targets = [], [], []
    for i in range(composite.size):
        for k, payload in enumerate(payloads):
            target = tmp_path / f"ran{i}_{k}"
            problems.append(composite.problem(i))
            responses.append(_tagged(payload.format(str(target))))
            targets.append(target)
    report = composite.score_batch(problems, responses)
    assert report.rewards == [0.0] * len(problems) and report.timeouts == 0
    assert [t for t in targets if t.exists()] == []
    entry = _entry(composite.problem(0))
    for verifier in (composite.data, ReseedingDataset(composite.data), "composite"):
        assert not admits(verifier, payloads[0].format(str(tmp_path / "x")), entry)
    # honest answers still score through the composite: each part's own answer
    honest = [composite.problem(i) for i in range(12)]
    assert composite.score_batch(honest, [_tagged(p.answer) for p in honest]).rewards == [1.0] * 12


@pytest.mark.parametrize("dataset", sorted(STALLING))
def test_a_stalling_answer_returns_within_the_limit_and_scores_0(dataset: str) -> None:
    env = ReasoningGymEnv(dataset, size=4, seed=0, answer_format="tagged", max_answer_chars=200,
                          score_timeout_s=LIMIT_S, score_workers=2)
    try:
        problem = env.problem(0)
        assert env.score(problem, _tagged(problem.answer)) == 1.0  # workers up
        start = time.monotonic()
        report = env.score_batch([problem] * 3, [_tagged(STALLING[dataset]), _tagged(problem.answer),
                                                 _tagged(problem.answer)])
        elapsed = time.monotonic() - start
        assert report.rewards == [0.0, 1.0, 1.0] and report.timeouts == 1 and report.errors == 0
        assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S
        assert env.score(problem, _tagged(problem.answer)) == 1.0  # a new worker took the killed one's place
    finally:
        env.close()


class Hostile:
    """A verifier that misbehaves as its answer says (picklable: it crosses to the scoring workers)."""

    def score_answer(self, answer: str, entry: dict[str, Any]) -> float:
        if answer == "sleep":
            time.sleep(60)
        elif answer == "spin":
            while True:
                pass
        elif answer == "exit":
            os._exit(3)
        elif answer == "raise":
            raise RecursionError("deep")
        elif answer == "nan":
            return math.nan
        elif answer == "memory":
            return float(len(bytearray(4 << 30)))
        elif answer == "write":
            with open(entry["path"], "w") as f:
                f.write("x" * 10)
        return float(entry.get("score", 1.0))


def test_stalled_or_crashing_verifiers_cost_their_answers_reward_and_nothing_else(tmp_path: Path) -> None:
    pool = ScoringPool(pickle.dumps(Hostile()), workers=2, timeout_s=LIMIT_S, memory_bytes=1 << 30)
    try:
        written = tmp_path / "written"
        answers = ["sleep", "ok", "spin", "exit", "raise", "nan", "memory", "write", "ok"]
        jobs = [(a, {"score": 0.5, "path": str(written)}) for a in answers]
        start = time.monotonic()
        report = pool.score(jobs)
        elapsed = time.monotonic() - start
        assert report.rewards == [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
        assert report.timeouts == 2 and report.errors == 5  # exit, raise, nan, memory, write (EFBIG)
        assert not written.exists() or written.stat().st_size == 0  # RLIMIT_FSIZE 0
        assert elapsed < 2 * LIMIT_S + 2 * SLACK_S  # the two late ones in parallel or back to back, not 60 s
        assert pool.score([("ok", {"score": 0.25})]).rewards == [0.25]
    finally:
        pool.close()


def test_a_worker_that_cannot_load_its_verifier_is_a_clear_error() -> None:
    pool = ScoringPool(b"not a pickle", workers=1)
    with pytest.raises(RuntimeError, match="failed while loading its verifier"):
        pool.score([("1", {})])


@pytest.mark.parametrize("setting", [{"score_timeout_s": 0}, {"score_timeout_s": -1.0}, {"score_timeout_s": math.nan},
                                     {"score_timeout_s": math.inf}, {"score_timeout_s": True},
                                     {"score_workers": 0}, {"score_workers": 1.5}])
def test_bad_scoring_settings_are_refused(setting: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(setting))):
        make_env("countdown", size=4, **setting)


def test_the_limit_is_an_env_setting() -> None:
    """data.env_kwargs reach the env: `--data.env_kwargs '{score_timeout_s: 0.5, score_workers: 3}'`."""
    from trace_lightning.lit.data import RLDataModule

    data = RLDataModule(env="countdown", env_kwargs={"size": 8, "score_timeout_s": 0.5, "score_workers": 3})
    for env in (data.env, data.eval_env):
        assert (env._pool.timeout_s, env._pool.workers) == (0.5, 3)
    assert make_env("countdown", size=4)._pool.timeout_s == 3.0


def test_pure_string_compare_scorers_score_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim presets (basic_arithmetic, chain_sum) never start a worker; countdown does; a pinned scorer whose
    source changed (a reasoning-gym upgrade) goes back to the pool."""
    for name, (helpers, pinned) in PURE_SCORERS.items():
        assert source_hash(name, helpers) == pinned, f"{name} changed: read it again before pinning it"
    for preset in ("arithmetic", "chain_sum"):
        env = make_env(preset, size=8)
        problem = env.problem(0)
        assert pure_scorer(env.data, _entry(problem))
        assert env.score(problem, problem.answer) == 1.0 and env._pool._workers == []
    countdown = make_env("countdown", size=4)
    assert not pure_scorer(countdown.data, _entry(countdown.problem(0)))
    from trace_lightning.envs import verifier_guard

    monkeypatch.setitem(PURE_SCORERS, "reasoning_gym.dataset.ProceduralDataset.score_answer", ((), "0" * 16))
    verifier_guard._is_pure.cache_clear()
    try:
        env = make_env("arithmetic", size=8)
        assert not pure_scorer(env.data, _entry(env.problem(0)))
    finally:
        verifier_guard._is_pure.cache_clear()


NEVER_RAISE = ["3**1e999", "3**-1e999", "2**(1e999-1e999)", "-" * 20_000 + "1", "(" * 5_000 + "1" + ")" * 5_000,
               "sin(" * 3_000 + "x" + ")" * 3_000, "1" + "+1" * 30_000, "x**" + "9" * 5_000, "\x00", "é**2", ""]


@pytest.mark.parametrize("answer", NEVER_RAISE, ids=lambda a: a[:12])
def test_screening_never_raises(answer: str) -> None:
    for dataset in sorted(EXPRESSION_VERIFIERS):
        assert isinstance(admits(dataset, answer), bool)
    try:
        check_expression(answer)
    except UnsafeAnswer:
        pass  # the only exception it may raise


def test_scoring_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    env = ReasoningGymEnv("countdown", size=4, seed=0, answer_format="line", max_answer_chars=100_000,
                          score_timeout_s=LIMIT_S, score_workers=2)
    try:
        problem = env.problem(0)
        monkeypatch.setattr("trace_lightning.envs.verifier_guard.MAX_ANSWER_CHARS", 100_000)
        report = env.score_batch([problem] * len(NEVER_RAISE), NEVER_RAISE)
        assert report.rewards == [0.0] * len(NEVER_RAISE) and report.timeouts == 0
        assert env.score(problem, None) == 0.0  # type: ignore[arg-type]
        assert env.score(Problem(prompt="p", answer="1", metadata={}), "1") == 0.0
        for entry in ({}, {"metadata": {}}, {"metadata": {"source_dataset": "nope"}}, None):
            assert not admits(reasoning_gym.create_dataset("composite", size=2, seed=0,
                                                           datasets=[DatasetSpec("countdown", 1, {})]), "1", entry)
    finally:
        env.close()


def test_the_rl_worker_logs_scoring_and_survives_a_raising_verifier() -> None:
    """A step's rollout scores through score_responses: a verifier that raises on every answer gives rewards 0,
    counted in reward/score_errors, and the step completes."""
    from trace_lightning.lit.config import RolloutConfig, TraceConfig
    from trace_lightning.lit.policy import PolicyModule

    module = PolicyModule(trace=TraceConfig(method="trace_compact"), rollout=RolloutConfig(prompts_per_step=2),
                          warmup_steps=0)
    env = make_env("arithmetic", size=20)
    problems = env.sample(2, seed=0)

    class Raising:
        def score(self, problem: Problem, response: str) -> float:
            raise RuntimeError("verifier crashed")

    batch = module.worker.rollout(Raising(), problems, seed=0)  # type: ignore[arg-type]
    stats = batch.rollout_stats
    assert stats["reward/score_errors"] == len(batch.rewards) > 0 and batch.rewards.abs().sum() == 0
    assert stats["reward/score_timeouts"] == 0 and stats["time/score_s"] > 0
    report = score_responses(env, problems, [p.answer for p in problems])
    assert report.rewards == [1.0, 1.0] and report.errors == 0 and report.stats()["time/score_s"] > 0


def test_the_list_guard_holds_in_a_worker(tmp_path: Path) -> None:
    """A list verifier inside a worker reads literals only: guard_list_verifiers ran there before it loaded."""
    guard_list_verifiers()
    env = ReasoningGymEnv("spiral_matrix", size=2, seed=0, answer_format="line", max_answer_chars=200,
                          partial_credit=True, score_workers=1)
    try:
        problem = env.problem(0)
        target = tmp_path / "ran"
        assert not pure_scorer(env.data, _entry(problem))
        assert env.score(problem, f"[__import__('os').mkdir({str(target)!r})]") == 0.0 and not target.exists()
        as_list = "[" + ", ".join(problem.answer.split()) + "]"
        assert env.score(problem, as_list) == pytest.approx(0.1)
        assert "eval" in inspect.getsource(type(env.data).score_answer)
    finally:
        env.close()


def test_workers_never_rerun_the_main_module(tmp_path: Path) -> None:
    """A script that scores, with no `if __name__ == "__main__":` guard: its workers do not run it again
    (multiprocessing would, in each one: under `trace-rl`, importing torch and lightning there). Before, the
    worker failed with multiprocessing's "bootstrapping phase" RuntimeError."""
    import subprocess
    import sys

    marker = tmp_path / "runs"
    script = tmp_path / "score_unguarded.py"
    script.write_text(
        "from trace_lightning.envs import make_env\n"
        f"open({str(marker)!r}, 'a').write('run\\n')\n"
        "env = make_env('countdown', size=2, score_workers=1)\n"
        "p = env.problem(0)\n"
        "print(env.score(p, p.answer))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1.0"] and marker.read_text() == "run\n"
