"""Verifiable tasks: prompts with ground truth and verifiers returning rewards."""

from trace_lightning.envs.base import ENVS, Env, Problem, make_env, register_env
from trace_lightning.envs.calculator import CalculatorEnv, ExpressionError, evaluate
from trace_lightning.envs.coding import TASKS, CodingEnv, program_from_response
from trace_lightning.envs.isolation import SandboxUnavailable
from trace_lightning.envs.multiturn import Episode, GuessNumberEnv, MultiTurnEnv, Reply, run_episode
from trace_lightning.envs.reasoning import (
    ANSWER_FORMATS,
    PROMPT_FORMATS,
    SIM_PRESETS,
    AnswerFormat,
    ReasoningGymEnv,
    extract_answer,
)
from trace_lightning.envs.sandbox import SandboxResult, run_sandboxed
from trace_lightning.envs.scoring import ScoreReport, ScoringPool, score_responses

__all__ = [
    "ANSWER_FORMATS",
    "ENVS",
    "PROMPT_FORMATS",
    "SIM_PRESETS",
    "TASKS",
    "AnswerFormat",
    "CalculatorEnv",
    "CodingEnv",
    "Env",
    "Episode",
    "ExpressionError",
    "GuessNumberEnv",
    "MultiTurnEnv",
    "Problem",
    "ReasoningGymEnv",
    "Reply",
    "SandboxResult",
    "ScoreReport",
    "ScoringPool",
    "SandboxUnavailable",
    "evaluate",
    "extract_answer",
    "make_env",
    "program_from_response",
    "register_env",
    "run_episode",
    "run_sandboxed",
    "score_responses",
]
