"""The worker's multi-turn rollouts: a TrainBatch whose loss mask holds only the policy's tokens, with the record,
the turn and env-time metrics, and greedy episodes for evaluation that the env's verifier scores."""

from __future__ import annotations

import re

from trace_lightning.envs import make_env
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.policy import PolicyModule


def test_worker_rollout_trains_only_the_policys_turns() -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"),
                          rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=44), warmup_steps=0)
    worker, env = module.worker, make_env("guess_number")
    problems = env.sample(2, seed=0)
    worker.audit_next = True  # every layer's codes recorded, as on an audit step
    batch = worker.rollout(env, problems, seed=0)
    stats = batch.rollout_stats
    assert 1 <= stats["multiturn/turns_per_episode"] <= env.max_turns and stats["time/env_s"] >= 0
    assert batch.audit_record is not None and batch.audit_record.data.shape[1] == batch.tokens.shape[1] - 1
    assert not worker.audit_next
    prompt_len = len(worker.encode_prompt(problems[0]))
    for b in range(batch.tokens.shape[0]):
        real = batch.attention_mask[b, 1:]
        after_prompt = real.clone()
        after_prompt[: prompt_len - 1] = False
        targets = batch.tokens[b, 1:]
        env_text = worker.decode_response(targets[after_prompt & ~batch.response_mask[b]].tolist())
        assert re.fullmatch(r"((higher|lower|invalid)\n)*", env_text), env_text  # only whole replies are masked
        assert batch.response_mask[b].sum() >= 1 and not batch.response_mask[b, ~real].any()
        assert (batch.rollout_logprobs[b, ~batch.response_mask[b]] == 0).all()
    rows = worker.predict_step(problems, 0, env=env)
    for p, row in zip(problems, rows, strict=True):
        assert env.score(p, row["response"]) in (0.0, 1.0)
        assert row["response"].endswith(("higher\n", "lower\n", "invalid\n", "correct\n"))
