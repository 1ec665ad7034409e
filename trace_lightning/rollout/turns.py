"""Multi-turn rollouts: episodes that alternate sampled policy turns and an environment's replies, batched.

Every episode is a row of one LiveBatch (rollout/live.py). Each iteration samples the next token of every row that
is mid-turn, from the logits of its last forward, and then feeds in one forward what each row has next: its sampled
token, or, for a row whose environment has answered, the token that ended its turn followed by the reply's tokens
(forced, prompt-like), which continue the row's KV cache without prefilling the conversation again. A turn ends
when its text ends with the env's turn_stop, at a stop token, or at max_turn_tokens tokens; the env's reply is then
asked from a worker thread and a reply that has not come within `env_timeout_s` ends its episode (reward 0). With
`replies="in_order"` (the default) every reply asked after a forward is taken (or timed out) before the next
forward, so which rows share a forward, and with it every logit, is a function of the seeds alone: a rerun gives the
same episodes bit for bit. `"as_ready"` feeds each reply as soon as it comes: a slow environment then holds up only
its own episode, but the rows a forward batches together depend on the environment's timing, and a row's logits on
its batch. An episode ends on the env's word
(Reply.done: its reward), when the next reply would not fit in max_new_tokens, or at that budget mid-turn
(reward 0). The reply that ends an episode is not fed: nothing is sampled after it, so every sequence ends with a
policy token, as a single-turn response does.

Sampling is the engine's (rollout/sampling.py): the policy's k-th token of an episode draws with its sequence key
at step k, so an episode's tokens are a function of its seed and the replies it got, never of the batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from trace_lightning.envs.multiturn import Reply
from trace_lightning.guidance.record import BatchRecord
from trace_lightning.rollout.batch import CaptureSpec, SamplingParams
from trace_lightning.rollout.sampling import sample, seed_keys, sequence_seeds

EpisodeEnd = Literal["env", "length", "timeout"]


@dataclass(frozen=True)
class TurnRules:
    """Where turns and episodes end."""

    turn_stop: str
    """A policy turn ends where its decoded text ends with this."""
    max_turn_tokens: int
    """... or at this many tokens."""
    max_new_tokens: int
    """Tokens after the prompt, the policy's and the replies' together."""

    def __post_init__(self) -> None:
        if not self.turn_stop:
            raise ValueError("turn_stop must be a non-empty string")
        if self.max_turn_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError(f"max_turn_tokens and max_new_tokens must be >= 1, got {self.max_turn_tokens}, "
                             f"{self.max_new_tokens}")


@dataclass
class EpisodeTokens:
    """One episode after its prompt: every token, which of them the policy sampled, and their logprobs."""

    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    """True where the policy sampled the token; False on the env's reply tokens."""
    logprobs: list[float] = field(default_factory=list)
    """The sampled tokens' logprobs (0 on reply tokens)."""
    turns: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    """Every reply the env gave, the one that ended the episode included (not in tokens)."""
    reward: float = 0.0
    end: EpisodeEnd | None = None

    @property
    def text(self) -> str:
        """turn_1 + reply_1 + ... as the env saw them."""
        return "".join(t + r for t, r in zip(self.turns, self.replies, strict=False)) + "".join(
            self.turns[len(self.replies):])


@dataclass
class MultiTurnRollout:
    """A batch of episodes, with routes (and records) of positions 0 .. len(prompt) + len(tokens) - 2 each."""

    prompts: list[list[int]]
    episodes: list[EpisodeTokens]
    route_table: Tensor
    record: BatchRecord | None
    policy_version: int
    stats: dict[str, float]

    def record_length(self, i: int) -> int:
        return len(self.prompts[i]) + len(self.episodes[i].tokens) - 1


@dataclass
class _Row:
    """An episode in flight."""

    ep: EpisodeTokens = field(default_factory=EpisodeTokens)
    turn: list[int] = field(default_factory=list)
    """This turn's sampled tokens so far."""
    waiting: cf.Future[tuple[Reply, float]] | None = None
    asked_at: float = 0.0
    next_feed: list[int] = field(default_factory=list)
    sampling: bool = True
    """The row's last forward gave the logits of its next policy token."""


def run_episodes(engine: object, prompts: Sequence[list[int]], rules: TurnRules, params: SamplingParams,
                 reply: Callable[[int, list[str]], Reply], decode: Callable[[list[int]], str],
                 encode_reply: Callable[[str], list[int]], *, capture: CaptureSpec | None = None,
                 env_timeout_s: float = 30.0, env_workers: int = 4,
                 replies: Literal["in_order", "as_ready"] = "in_order") -> MultiTurnRollout:
    """Play one episode per prompt. reply(i, turns): episode i's env reply to its turns so far (called from worker
    threads); decode(ids): a turn's text (stop ids read as nothing); encode_reply(text): a reply's tokens (through
    the chat template where there is one). params: temperature, top-k / top-p, seed(s) and stop ids as for
    Engine.generate (max_new_tokens and min_new_tokens are the rules' and unused)."""
    from trace_lightning.rollout.engine import Engine  # the engine imports this package

    assert isinstance(engine, Engine)
    n, dev = len(prompts), engine.device
    if n == 0:
        raise ValueError("run_episodes needs at least one prompt")
    if env_timeout_s <= 0:
        raise ValueError(f"env_timeout_s must be > 0, got {env_timeout_s}")
    if replies not in ("in_order", "as_ready"):
        raise ValueError(f"replies must be 'in_order' or 'as_ready', got {replies!r}")
    seeds = (sequence_seeds(int(params.seed), n) if isinstance(params.seed, int) else list(params.seed))
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts")
    keys, stops = seed_keys(seeds, dev), set(params.stop_token_ids)
    longest = max(len(p) for p in prompts)
    live = engine.open_live(n, longest + 2 * rules.max_new_tokens + 1, capture)
    rows = [_Row() for _ in range(n)]
    env_s = decode_s = 0.0
    forwards = 0
    start = time.perf_counter()
    pool = cf.ThreadPoolExecutor(max_workers=max(1, env_workers), thread_name_prefix="env")
    try:
        logits = live.feed([list(p) for p in prompts])
        while True:
            active = [i for i, row in enumerate(rows) if row.ep.end is None and row.sampling]
            if active:
                _sample_turn_tokens(rows, active, logits, keys, params, stops, rules, decode, reply, pool)
            if replies == "in_order":
                _await_replies(rows, env_timeout_s)
            env_s += _collect_replies(rows, rules, encode_reply, env_timeout_s, stops)
            if all(row.ep.end is not None for row in rows):
                break
            feeds = [row.next_feed if row.ep.end is None else [] for row in rows]
            if not any(feeds):  # every live episode waits for its env
                waiting = [row.waiting for row in rows if row.waiting is not None]
                cf.wait(waiting, timeout=_time_left(rows, env_timeout_s), return_when=cf.FIRST_COMPLETED)
                continue
            t0 = time.perf_counter()
            logits = live.feed(feeds)
            decode_s += time.perf_counter() - t0
            forwards += 1
            for row, fed in zip(rows, feeds, strict=True):
                row.sampling, row.next_feed = bool(fed), [] if fed else row.next_feed
    finally:  # a timed-out reply still running is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    lengths = [len(p) + len(row.ep.tokens) - 1 for p, row in zip(prompts, rows, strict=True)]
    routes = live.route_table(lengths)
    record = live.batch_record(lengths, routes)
    episodes = [row.ep for row in rows]
    stats = {"time/env_s": env_s, "rollout/decode_s": decode_s, "rollout/forwards": float(forwards),
             "multiturn/turns_per_episode": sum(len(e.turns) for e in episodes) / n,
             "multiturn/env_tokens": float(sum(len(e.tokens) - sum(e.policy) for e in episodes)),
             "multiturn/timeouts": float(sum(e.end == "timeout" for e in episodes)),
             "multiturn/truncated": float(sum(e.end == "length" for e in episodes)),
             "rollout/wall_s": time.perf_counter() - start}
    return MultiTurnRollout([list(p) for p in prompts], episodes, routes, record, engine.policy_version, stats)


def _sample_turn_tokens(rows: list[_Row], active: list[int], logits: Tensor, keys: Tensor, params: SamplingParams,
                        stops: set[int], rules: TurnRules, decode: Callable[[list[int]], str],
                        reply: Callable[[int, list[str]], Reply], pool: cf.ThreadPoolExecutor) -> None:
    """Draw the next policy token of every active row; end its turn (ask the env) or its episode where due."""
    index = torch.tensor(active, device=logits.device)
    steps = torch.tensor([sum(rows[i].ep.policy) for i in active], device=logits.device)[:, None]
    tokens, logprobs = sample(logits[index], keys[index], steps, params.temperature, params.top_k, params.top_p)
    for i, tok, lp in zip(active, tokens.tolist(), logprobs.tolist(), strict=True):
        row = rows[i]
        row.ep.tokens.append(tok)
        row.ep.policy.append(True)
        row.ep.logprobs.append(lp)
        row.turn.append(tok)
        text = decode(row.turn)
        if tok in stops or text.endswith(rules.turn_stop) or len(row.turn) >= rules.max_turn_tokens:
            row.ep.turns.append(text)
            row.turn, row.sampling = [], False
            row.waiting, row.asked_at = pool.submit(_timed, reply, i, list(row.ep.turns)), time.perf_counter()
        elif len(row.ep.tokens) >= rules.max_new_tokens:
            row.ep.end, row.sampling = "length", False
        else:
            row.next_feed = [tok]


def _collect_replies(rows: list[_Row], rules: TurnRules, encode_reply: Callable[[str], list[int]],
                     timeout_s: float, stops: set[int]) -> float:
    """Take every reply that has come (or timed out): end the episode or queue the reply's tokens. -> the seconds
    the env spent on the replies taken (a timed-out one: the time it was given)."""
    now, spent = time.perf_counter(), 0.0
    for row in rows:
        if row.waiting is None:
            continue
        if not row.waiting.done():
            if now - row.asked_at >= timeout_s:
                row.waiting.cancel()
                row.waiting, row.ep.end = None, "timeout"
                spent += timeout_s
            continue
        answer, seconds = row.waiting.result()  # an env that raises fails the rollout, naming its error
        spent += seconds
        row.waiting = None
        row.ep.replies.append(answer.text)
        if answer.done:
            row.ep.reward, row.ep.end = answer.reward, "env"
            continue
        forced = encode_reply(answer.text)
        if forced and forced[0] == row.ep.tokens[-1] in stops:  # the template's end of turn, already sampled
            forced = forced[1:]
        if len(row.ep.tokens) + len(forced) >= rules.max_new_tokens:  # no room for another policy token
            row.ep.end = "length"
            continue
        row.next_feed = [row.ep.tokens[-1], *forced]
        row.ep.tokens += forced
        row.ep.policy += [False] * len(forced)
        row.ep.logprobs += [0.0] * len(forced)
    return spent


def _timed(reply: Callable[[int, list[str]], Reply], i: int, turns: list[str]) -> tuple[Reply, float]:
    """reply(i, turns) and the seconds it took (in its worker thread)."""
    start = time.perf_counter()
    answer = reply(i, turns)
    if not isinstance(answer, Reply):
        raise TypeError(f"the env's reply to episode {i} is a {type(answer).__name__}, not a Reply")
    return answer, time.perf_counter() - start


def _await_replies(rows: list[_Row], timeout_s: float) -> None:
    """Wait until every asked reply has come or run out of its time (then _collect_replies ends its episode)."""
    while True:
        now = time.perf_counter()
        pending = [row for row in rows
                   if row.waiting is not None and not row.waiting.done() and now - row.asked_at < timeout_s]
        if not pending:
            return
        left = min(timeout_s - (now - row.asked_at) for row in pending)
        cf.wait([row.waiting for row in pending if row.waiting is not None], timeout=left,
                return_when=cf.FIRST_COMPLETED)


def _time_left(rows: list[_Row], timeout_s: float) -> float:
    """Seconds until the first waiting reply times out."""
    now = time.perf_counter()
    return max(0.0, min(timeout_s - (now - row.asked_at) for row in rows if row.waiting is not None))
