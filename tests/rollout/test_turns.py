"""Multi-turn rollouts: env replies sit between the policy's turns, carry no loss or mismatch, and decoding the
conversation on its live KV cache gives the logits of one forward over the whole conversation."""

import itertools
import threading
import time

import pytest
import torch

from trace_lightning.envs import Reply
from trace_lightning.lit.episodes import align_episodes
from trace_lightning.model import Transformer
from trace_lightning.model.tokenizer import CharTokenizer
from trace_lightning.rl.metrics import mismatch_metrics
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams
from trace_lightning.rollout.live import LiveBatch
from trace_lightning.rollout.turns import MultiTurnRollout, TurnRules, run_episodes

TOK = CharTokenizer()
PROMPTS = [TOK.encode_prompt(t) for t in ("guess 1-15:\n", "go\n", "what is 12*13+4?\n", "x\n")]
RULES = TurnRules(turn_stop=" ", max_turn_tokens=3, max_new_tokens=30)


def _decode(ids: list[int]) -> str:
    """The worker's reading of a turn: ids past the character vocabulary (the model's is larger) as '?'."""
    return "".join("?" if t >= TOK.vocab_size else TOK.decode([t]) for t in ids)


def _reply(i: int, turns: list[str]) -> Reply:
    """A reply naming the episode and turn (so each sits where it belongs); episode i ends after i + 1 turns."""
    return Reply(f"<{i}.{len(turns)}>\n", len(turns) > i, reward=0.25 * i)


def _play(engine: Engine, capture: CaptureSpec | None = None, reply=_reply, **kwargs) -> MultiTurnRollout:  # noqa: ANN001
    return run_episodes(engine, PROMPTS, RULES, SamplingParams(temperature=1.0, seed=5, stop_token_ids=[2]), reply,
                        _decode, TOK.encode, capture=capture, **kwargs)


def test_replies_sit_between_the_policy_turns_and_carry_no_loss_or_mismatch(model: Transformer) -> None:
    out = _play(Engine(model, FP4Precision(compute_dtype="fp32")))
    for i, ep in enumerate(out.episodes):
        assert ep.end == "env" and ep.reward == 0.25 * i and len(ep.turns) == i + 1 == len(ep.replies)
        runs = [(q, [t for _, t in run]) for q, run in itertools.groupby(zip(ep.policy, ep.tokens, strict=True),
                                                                         key=lambda x: x[0])]
        # turn_1, reply_1, ..., turn_n: the policy's runs are its turns, the others the replies' tokens in order
        assert [q for q, _ in runs] == [True, False] * i + [True]
        assert [_decode(run) for q, run in runs if q] == ep.turns
        assert [run for q, run in runs if not q] == [TOK.encode(f"<{i}.{k}>\n") for k in range(1, i + 1)]
        assert ep.replies[-1] == f"<{i}.{i + 1}>\n"  # the reply that ended the episode: not fed
        assert all(lp == 0.0 for lp, p in zip(ep.logprobs, ep.policy, strict=True) if not p)
        assert all(lp < 0.0 for lp, p in zip(ep.logprobs, ep.policy, strict=True) if p)
    assert out.stats["multiturn/turns_per_episode"] == 2.5 and out.stats["multiturn/env_tokens"] == 6 * 6

    batch = align_episodes(out, TOK.pad_id, group_size=2)
    for b, (p, ep) in enumerate(zip(out.prompts, out.episodes, strict=True)):
        targets = batch.tokens[b, 1:]
        mask = batch.response_mask[b]
        assert mask.sum() == sum(ep.policy)
        assert targets[mask].tolist() == [t for t, q in zip(ep.tokens, ep.policy, strict=True) if q]
        env_cols = [len(p) - 1 + j for j, q in enumerate(ep.policy) if not q]
        assert not mask[env_cols].any() and (batch.rollout_logprobs[b, env_cols] == 0).all()
    # a training logprob that differs only at the env's tokens changes no mismatch metric
    train = batch.rollout_logprobs.clone()
    off_policy = ~batch.response_mask & (batch.rollout_logprobs == 0)
    moved = train.masked_fill(off_policy, -7.0)
    assert mismatch_metrics(moved, batch.rollout_logprobs, batch.response_mask) == mismatch_metrics(
        train, batch.rollout_logprobs, batch.response_mask)


def test_live_cache_logits_equal_one_forward_over_the_conversation(model: Transformer,
                                                                   base_model: Transformer) -> None:
    """Every feed of the multi-turn rollout (the prompt, each sampled token, each turn's last token with the env's
    reply) gives the logits of one forward over the whole conversation at that position, and the record (routes and
    FP4 codes) of every position, the replies' included, is what one prefill of the conversation records.

    Not bit for bit: fp32 on the sim backend, logits differ by up to ~1e-6 (a few ulps) and 0.3% of the record's
    bytes flip (a code at a rounding boundary), because a feed's GEMMs have other shapes (rows x tokens fed) than
    the one forward's, and BLAS blocks their reductions differently; the single-turn engine's decode steps differ
    from a full forward the same way (tests/rollout/test_engine.py compares at 1e-4). So: atol 1e-5, rtol 0 on the
    logits and logprobs, and >= 99% of routes and record bytes. Training stays exact either way: it replays the
    rollout's own record and logprobs, not a recomputation."""
    engine = Engine(model, FP4Precision(compute_dtype="fp32"))
    feeds: list[tuple[list[int], list[list[int]], torch.Tensor]] = []
    original = LiveBatch.feed

    def spy(self: LiveBatch, tokens: list[list[int]]) -> torch.Tensor:
        before = list(self.lengths)
        logits = original(self, tokens)
        feeds.append((before, tokens, logits.clone()))
        return logits

    LiveBatch.feed = spy
    try:
        out = _play(engine, capture=CaptureSpec())
    finally:
        LiveBatch.feed = original
    seqs = [p + ep.tokens for p, ep in zip(out.prompts, out.episodes, strict=True)]
    whole = engine.open_live(len(seqs), max(map(len, seqs)), CaptureSpec())
    with torch.inference_mode():
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        whole.cache.visible = width
        full = engine._forward(ids, torch.arange(width).expand(len(seqs), width), whole.cache, whole.hook,
                               whole.recorder)  # (B, T, V) at every position
    whole.lengths = [len(s) for s in seqs]
    checked = 0
    for before, tokens, logits in feeds:
        for r, fed in enumerate(tokens):
            if fed and before[r] + len(fed) < len(seqs[r]):  # the feed's last position predicts a real token
                torch.testing.assert_close(logits[r], full[r, before[r] + len(fed) - 1], rtol=0, atol=1e-5)
                checked += 1
    assert checked == sum(sum(ep.policy) for ep in out.episodes)  # each policy token was predicted by one feed
    for b, (p, ep) in enumerate(zip(out.prompts, out.episodes, strict=True)):
        lp = full[b, len(p) - 1: len(p) - 1 + len(ep.tokens)].float().log_softmax(-1)
        picked = lp.gather(-1, torch.tensor(ep.tokens)[:, None]).squeeze(-1)
        policy = torch.tensor(ep.policy)
        torch.testing.assert_close(picked[policy], torch.tensor(ep.logprobs)[policy], rtol=0, atol=1e-5)
    lengths = [len(s) - 1 for s in seqs]
    routes = whole.route_table(lengths)
    width = min(routes.shape[2], out.route_table.shape[2])
    assert (routes[:, :, :width] == out.route_table[:, :, :width]).float().mean() >= 0.99
    one = whole.batch_record(lengths, routes)
    assert out.record is not None and one is not None
    assert torch.equal(out.record.valid[:, : one.valid.shape[1]], one.valid)
    assert (out.record.data[:, : one.data.shape[1]][one.valid] == one.data[one.valid]).float().mean() >= 0.99


def test_a_slow_env_times_out_its_episode_while_the_others_finish(model: Transformer) -> None:
    release = threading.Event()

    def stuck_for_episode_0(i: int, turns: list[str]) -> Reply:
        if i == 0:
            release.wait(60.0)  # a sandboxed program that hangs: answers only once the test lets it
        return Reply("ok\n", len(turns) >= 3, reward=1.0)

    try:
        out = _play(Engine(model, "fp32"), reply=stuck_for_episode_0, env_timeout_s=0.5)
        assert not release.is_set()  # the rollout ended without that reply: nobody waited for it
    finally:
        release.set()
    assert out.episodes[0].end == "timeout" and out.episodes[0].reward == 0.0 and len(out.episodes[0].turns) == 1
    assert all(ep.end == "env" and ep.reward == 1.0 and len(ep.turns) == 3 for ep in out.episodes[1:])
    assert out.stats["multiturn/timeouts"] == 1.0


def test_replies_in_order_make_episodes_a_function_of_the_seed(model: Transformer) -> None:
    """However long each reply takes, in_order feeds the same rows together: a rerun gives the same episodes, bit
    for bit (logprobs included), though the replies come back in another order."""
    def jittery(delays: list[float]) -> object:
        waits = itertools.cycle(delays)
        lock = threading.Lock()

        def reply(i: int, turns: list[str]) -> Reply:
            with lock:
                delay = next(waits)
            time.sleep(delay)
            return Reply(f"<{i}.{len(turns)}>\n", len(turns) >= 3, reward=1.0)
        return reply

    engine = Engine(model, FP4Precision(compute_dtype="fp32"))
    runs = [_play(engine, reply=jittery(d), replies="in_order") for d in ([0.0, 0.03, 0.01], [0.03, 0.0, 0.02, 0.0])]
    for a, b in zip(runs[0].episodes, runs[1].episodes, strict=True):
        assert a.tokens == b.tokens and a.policy == b.policy and a.logprobs == b.logprobs and a.turns == b.turns
    assert runs[0].stats["rollout/forwards"] == runs[1].stats["rollout/forwards"]
    with pytest.raises(ValueError, match="replies must be 'in_order' or 'as_ready'"):
        _play(engine, replies="sometimes")


def test_episodes_end_at_the_token_budget_and_bad_input_is_named(model: Transformer) -> None:
    engine = Engine(model, "fp32")
    out = run_episodes(engine, PROMPTS[:2], TurnRules(" ", 3, 8), SamplingParams(seed=1),
                       lambda i, t: Reply("a long reply\n", False), _decode, TOK.encode)
    assert all(ep.end == "length" and ep.reward == 0.0 and len(ep.tokens) < 8 for ep in out.episodes)
    with pytest.raises(ValueError, match="turn_stop"):
        TurnRules("", 3, 8)
    with pytest.raises(ValueError, match="env_timeout_s"):
        run_episodes(engine, PROMPTS, RULES, SamplingParams(), _reply, _decode, TOK.encode, env_timeout_s=0)
    with pytest.raises(TypeError, match="not a Reply"):
        run_episodes(engine, PROMPTS, RULES, SamplingParams(), lambda i, t: "higher", _decode, TOK.encode)
    live = engine.open_live(2, 4)
    with pytest.raises(ValueError, match="one token list per row"):
        live.feed([[1]])
    with pytest.raises(ValueError, match="needs 6 positions"):
        live.feed([[1] * 6, []])
