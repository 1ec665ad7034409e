"""Reasoning tasks from reasoning-gym generators, with compact prompts for the tiny simulator policy.

reasoning-gym's questions carry long instructions ("State the final answer to the following arithmetic
problem: ..."). The simulator's policy is a ~1M-parameter character model (printable ASCII, <= 128 tokens
of context), so the sim presets rebuild a compact prompt from the problem's fields instead:

    arithmetic / chain_sum    prompt "3+4-2="              answer "5"
    countdown                 prompt "make 17 from 9 23 15:"  answer "23-15+9"

The response is the text generated after the prompt. Extraction strips leading whitespace and keeps the
longest prefix made of answer characters (an optionally signed integer, or for countdown digits, + - * /,
parentheses and spaces); anything after it (EOS, a newline, junk) is ignored, and a response that does not
start with an answer scores 0. The extracted answer is scored by the dataset's own `score_answer`; its
partial credit (e.g. 0.5 for "17" when the answer is "7", 0.05 for a wrong countdown expression) is
rounded down to 0 unless `partial_credit=True`, so the sim reward is exactly 0 or 1.

Scoring never raises and never stalls: the answer is screened for the verifier that actually reads it
(verifier_guard.admits, through composite), pure string-compare verifiers score in this process, and every other
verifier scores in a ScoringPool (envs/scoring.py) with `score_timeout_s` of wall clock per answer (default 3 s)
on `score_workers` processes; a late or crashing verifier scores 0. `score_batch` scores a step's responses in
parallel and counts timeouts and errors.

Problems are generated lazily by index: the env holds `size` problems fixed by `seed`, and
`sample(n, seed)` draws n distinct indices from them. reasoning-gym seeds item i with seed + i, so a
held-out env should use a seed at least `size` away from the training env's. Each index is generated once and
kept: reasoning-gym builds an item on every access, and a countdown item takes ~2.5 ms to build, which at 256
demonstrations a warm-start step was most of a GPU step's host time.
"""

from __future__ import annotations

import pickle
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS
from reasoning_gym.utils import extract_answer as tagged_answer

from trace_lightning.envs.base import Problem, register_env
from trace_lightning.envs.scoring import SCORE_TIMEOUT_S, ScoreReport, ScoringPool
from trace_lightning.envs.verifier_guard import admits, guard_list_verifiers, pure_scorer


def _expression_prompt(entry: dict[str, Any]) -> str:
    return entry["metadata"]["expression"].replace(" ", "") + "="


def _countdown_prompt(entry: dict[str, Any]) -> str:
    md = entry["metadata"]
    return f"make {md['target']} from {' '.join(str(n) for n in md['numbers'])}:"


def _instructed_prompt(entry: dict[str, Any]) -> str:
    """reasoning-gym's default system prompt (think, then the answer in <answer> tags) and the task's question, as one
    user message: for pretrained chat models (some chat templates refuse a system turn)."""
    return f"{SYSTEM_PROMPTS['default']}\n\n{entry['question']}"


PROMPT_FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "native": lambda entry: entry["question"],
    "instructed": _instructed_prompt,
    "expression": _expression_prompt,
    "countdown": _countdown_prompt,
}


@dataclass(frozen=True)
class AnswerFormat:
    """How an answer is cut out of a response, and how the reference answer is written."""

    pattern: str
    """Regex matched at the start of the (left-stripped) response."""
    compact: bool = False
    """Drop spaces from the reference answer (so the demonstration is short)."""
    forbidden: tuple[str, ...] = ()
    """Substrings that make the extracted answer invalid (e.g. "**": the verifier would evaluate it)."""
    tag: str | None = None
    """Instead of `pattern`: the answer is the last <tag>...</tag> anywhere in the response (reasoning after it or
    before it, in <think> blocks or not), as reasoning-gym's own extract_answer reads it."""


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "integer": AnswerFormat(r"[+-]?\d+"),
    "expression": AnswerFormat(r"[0-9+\-*/() ]+", compact=True, forbidden=("**",)),
    "line": AnswerFormat(r"[^\n]*"),
    "tagged": AnswerFormat("", tag="answer"),
}


def extract_answer(response: str, fmt: AnswerFormat, max_chars: int = 64) -> str | None:
    """The answer at the start of response (or in its last answer tag), or None when there is none (or it is invalid
    / too long)."""
    if fmt.tag is not None:
        answer = tagged_answer(response, tag_name=fmt.tag) or ""
    else:
        match = re.match(fmt.pattern, response.lstrip())
        answer = match.group(0).strip() if match else ""
    if not answer or len(answer) > max_chars or any(bad in answer for bad in fmt.forbidden):
        return None
    return answer


def _lookup(table: dict[str, Any], name: str, kind: str) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


class ReasoningGymEnv:
    """A reasoning-gym dataset as an Env. dataset_kwargs go to the dataset's config."""

    def __init__(
        self,
        dataset: str,
        size: int = 10_000,
        seed: int = 0,
        prompt_format: str = "native",
        answer_format: str = "line",
        partial_credit: bool = False,
        max_answer_chars: int = 64,
        score_timeout_s: float = SCORE_TIMEOUT_S,
        score_workers: int | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        self.name = dataset
        self.size, self.seed = size, seed
        self._settings = dict(dataset=dataset, prompt_format=prompt_format, answer_format=answer_format,
                              partial_credit=partial_credit, max_answer_chars=max_answer_chars,
                              score_timeout_s=score_timeout_s, score_workers=score_workers, **dataset_kwargs)
        self.prompt_fn = _lookup(PROMPT_FORMATS, prompt_format, "prompt format")
        self.answer_fmt = _lookup(ANSWER_FORMATS, answer_format, "answer format")
        self.partial_credit = partial_credit
        self.max_answer_chars = max_answer_chars
        self.data = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **dataset_kwargs)
        guard_list_verifiers()  # model answers never run as code (envs/verifier_guard.py)
        try:
            verifier = pickle.dumps(self.data)
        except Exception as e:
            raise ValueError(f"reasoning-gym dataset {dataset!r} cannot be sent to a scoring worker: {e}") from e
        self._pool = ScoringPool(verifier, workers=score_workers, timeout_s=score_timeout_s,
                                 prepare=guard_list_verifiers, preload=("reasoning_gym",))
        self._made: dict[int, Problem] = {}

    def close(self) -> None:
        """Stop the scoring workers (they also stop when the env is collected)."""
        self._pool.close()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickled for a loader worker) gets a pool of its own, started when it first scores."""
        state = dict(vars(self))
        pool = state.pop("_pool")
        state["_pool_settings"] = (pool.verifier, pool.workers, pool.timeout_s)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        verifier, workers, timeout_s = state.pop("_pool_settings")
        vars(self).update(state)
        self._pool = ScoringPool(verifier, workers=workers, timeout_s=timeout_s, prepare=guard_list_verifiers,
                                 preload=("reasoning_gym",))

    def held_out(self) -> ReasoningGymEnv:
        """The same task from the next `size` item seeds: problems this env never draws (reasoning-gym seeds item i
        with seed + i), for evaluation. Where the task has few distinct problems (the sim's one-digit arithmetic:
        200) the two still share problems by content."""
        return ReasoningGymEnv(size=self.size, seed=self.seed + self.size, **self._settings)

    def problem(self, index: int) -> Problem:
        """The index-th problem of the dataset (built on first use, then the same object)."""
        made = self._made.get(index)
        if made is None:
            made = self._made[index] = self._build(index)
        return made

    def _build(self, index: int) -> Problem:
        entry = self.data[index]
        answer = entry["answer"].replace(" ", "") if self.answer_fmt.compact else entry["answer"]
        metadata = {
            "dataset": self.name,
            "index": index,
            "question": entry["question"],
            "rg_answer": entry["answer"],
            "rg_metadata": entry["metadata"],
        }
        return Problem(prompt=self.prompt_fn(entry), answer=answer, metadata=metadata)

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        indices = rng.sample(range(self.size), n) if n <= self.size else [rng.randrange(self.size) for _ in range(n)]
        return [self.problem(i) for i in indices]

    def score(self, problem: Problem, response: str) -> float:
        """The response's reward in [0, 1]; never raises, returns within about score_timeout_s."""
        return self.score_batch([problem], [response]).rewards[0]

    def score_batch(self, problems: list[Problem], responses: list[str]) -> ScoreReport:
        """Rewards of responses[i] for problems[i]: refused answers score 0 here, pure string-compare verifiers score
        in this process, the rest in the scoring pool at once (parallel, each within score_timeout_s)."""
        report = ScoreReport(rewards=[0.0] * len(problems))
        queued: list[int] = []
        jobs: list[tuple[str, dict[str, Any]]] = []
        for i, (problem, response) in enumerate(zip(problems, responses, strict=True)):
            try:
                answer = extract_answer(response, self.answer_fmt, self.max_answer_chars)
                md = problem.metadata
                entry = {"question": md["question"], "answer": md["rg_answer"], "metadata": md["rg_metadata"]}
                if answer is None or not admits(self.data, answer, entry):
                    continue
                if pure_scorer(self.data, entry):
                    report.rewards[i] = self._reward(float(self.data.score_answer(answer, entry)))
                else:
                    queued.append(i)
                    jobs.append((answer, entry))
            except Exception:  # odd input (a response that is no string, a problem of another env): reward 0
                report.errors += 1
        if jobs:
            scored = self._pool.score(jobs)
            for i, value in zip(queued, scored.rewards, strict=True):
                report.rewards[i] = self._reward(value)
            report.timeouts, report.errors = scored.timeouts, report.errors + scored.errors
        return report

    def _reward(self, value: float) -> float:
        """A verifier's score as the reward: clipped to [0, 1], rounded down to 0 or 1 without partial credit."""
        if value != value:  # NaN
            return 0.0
        if not self.partial_credit:
            return 1.0 if value >= 1.0 else 0.0
        return min(max(value, 0.0), 1.0)

    def demonstration(self, problem: Problem) -> str:
        tag = self.answer_fmt.tag
        return problem.answer if tag is None else f"<{tag}>{problem.answer}</{tag}>"


SIM_PRESETS: dict[str, dict[str, Any]] = {
    "arithmetic": dict(
        dataset="basic_arithmetic",
        prompt_format="expression",
        answer_format="integer",
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+", "-"),
        allow_parentheses=False,
        allow_negation=False,
        whitespace="no_space",
    ),
    "chain_sum": dict(
        dataset="chain_sum",
        prompt_format="expression",
        answer_format="integer",
        min_terms=2,
        max_terms=3,
        min_digits=1,
        max_digits=1,
    ),
    "countdown": dict(
        dataset="countdown",
        prompt_format="countdown",
        answer_format="expression",
        min_numbers=3,
        max_numbers=4,
        min_value=1,
        max_value=25,
        min_target=10,
        max_target=100,
    ),
}
"""Presets: small arithmetic for the sim policy; countdown (search over expressions) for larger models."""


def _preset_factory(name: str) -> Callable[..., ReasoningGymEnv]:
    def build(**overrides: Any) -> ReasoningGymEnv:
        return ReasoningGymEnv(**{**SIM_PRESETS[name], **overrides})

    build.__doc__ = f"ReasoningGymEnv with the {name!r} preset; keyword arguments override it."
    return build


register_env("reasoning_gym")(ReasoningGymEnv)
for _name in SIM_PRESETS:
    register_env(_name)(_preset_factory(_name))
