"""Multi-turn rollouts in the RL loop: the worker's episodes (rollout/turns.py) aligned into a TrainBatch.

The sequence is prompt + turn_1 + reply_1 + ... + turn_n. The env's reply tokens are prompt-like: response_mask is
True only where the target is a token the policy sampled, so the loss, the mismatch metrics and route agreement
(all read response_mask) see the policy's tokens only; the replies' positions are recorded as a prompt's are (the
rollout fed them through the same FP4 forward), so guided training and routing replay stay exact over the whole
conversation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trace_lightning.envs import MultiTurnEnv, Problem
from trace_lightning.lit.batch import TrainBatch, pad_sequences, place
from trace_lightning.rollout.turns import MultiTurnRollout, TurnRules, run_episodes

if TYPE_CHECKING:
    from trace_lightning.lit.worker import RolloutWorker


def play(worker: RolloutWorker, env: MultiTurnEnv, problems: list[Problem], prompts: list[list[int]],
         seed: int | Sequence[int], greedy: bool = False, capture: Any = None) -> MultiTurnRollout:
    """One episode per prompt; prompt i plays problems[i * len(problems) // len(prompts)]."""
    per = len(prompts) // len(problems)
    rules = TurnRules(env.turn_stop, env.max_turn_tokens, worker.rollout_cfg.max_new_tokens)
    return run_episodes(worker.engine, prompts, rules, worker.sampling_params(seed, greedy),
                        lambda i, turns: env.reply(problems[i // per], turns), worker.decode_response,
                        worker.tokenizer.encode_reply, capture=capture,
                        env_timeout_s=worker.rollout_cfg.env_timeout_s, replies=worker.rollout_cfg.env_replies)


def multiturn_rollout(worker: RolloutWorker, env: MultiTurnEnv, problems: list[Problem],
                      seed: int | Sequence[int]) -> TrainBatch:
    """group_size episodes per problem, aligned for training; rewards are the episodes' last replies'."""
    g, prompts, capture = worker.rollout_cfg.group_size, worker.group_prompts(problems), worker.capture_spec()
    start = time.perf_counter()
    out = play(worker, env, problems, prompts, seed, capture=capture)
    elapsed = time.perf_counter() - start
    rewards = torch.tensor([e.reward for e in out.episodes], dtype=torch.float32)
    batch = align_episodes(out, worker.tokenizer.pad_id, g)
    n_policy = int(batch.response_mask.sum())
    batch.rollout_stats = {"rollout/tokens_per_s": n_policy / max(elapsed, 1e-9), "time/rollout_s": elapsed,
                           "rollout/decode_steps": out.stats["rollout/forwards"], **out.stats}
    batch.rewards = rewards
    batch.samples = [{"prompt": problems[i // g].prompt, "response": _transcript(out, i), "reward": float(rewards[i])}
                     for i in range(0, len(prompts), max(1, len(prompts) // 4))]
    if out.record is not None:
        worker._attach_records(batch, out)  # type: ignore[arg-type]  (reads out.record only)
    worker.audit_next = False
    return batch


def align_episodes(out: MultiTurnRollout, pad_id: int, group_size: int) -> TrainBatch:
    """tokens = prompt + episode tokens; response_mask and rollout_logprobs on the policy's tokens only."""
    seqs = [p + e.tokens for p, e in zip(out.prompts, out.episodes, strict=True)]
    tokens, attention_mask = pad_sequences(seqs, pad_id)
    width = tokens.shape[1]
    starts = [len(p) - 1 for p in out.prompts]
    response_mask = place([e.policy for e in out.episodes], starts, width - 1, False, torch.bool)
    logprobs = place([e.logprobs for e in out.episodes], starts, width - 1, 0.0, torch.float32)
    table = out.route_table[:, :, : width - 1].long()
    lengths = torch.tensor([out.record_length(i) for i in range(len(seqs))], device=table.device)
    real = torch.arange(width - 1, device=table.device) < lengths[:, None]
    routes = list(torch.where(real[None, :, :, None], table, 0).unbind(0))
    return TrainBatch(tokens=tokens, attention_mask=attention_mask, response_mask=response_mask,
                      rollout_logprobs=logprobs, rewards=torch.zeros(len(seqs)), group_size=group_size,
                      policy_version=out.policy_version, routes=routes)


def _transcript(out: MultiTurnRollout, i: int) -> str:
    """Episode i as the env saw it, its last reply included."""
    return out.episodes[i].text


def multiturn_predict(worker: RolloutWorker, env: MultiTurnEnv, problems: list[Problem],
                      batch_idx: int) -> list[dict[str, Any]]:
    """Greedy episodes (evaluation): the response is the transcript, which env.score replays."""
    out = play(worker, env, problems, [worker.encode_prompt(p) for p in problems], batch_idx, greedy=True)
    return [{"prompt": p.prompt, "response": _transcript(out, i), "answer": p.answer}
            for i, p in enumerate(problems)]
