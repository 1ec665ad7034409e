"""The rollout worker around the engine: an RL fit's rollouts keep one decode session (audit rollouts, every layer's
codes, leave it in place), and responses are decoded to text as the tokenizer decodes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_lightning.envs import make_env
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.rollout.engine import Engine

from ..rollout.test_decode_graph import keep_sessions


def test_an_audit_rollout_leaves_the_kept_session_to_the_next_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"), rollout=RolloutConfig(prompts_per_step=2),
                          warmup_steps=0)
    worker, env = module.worker, make_env("arithmetic", size=20)
    keep_sessions(monkeypatch, worker.engine)
    problems = env.sample(2, seed=0)
    worker.rollout(env, problems, seed=0)
    session = worker.engine._session
    assert session is not None

    def rollout(audit: bool) -> dict[str, float]:
        worker.audit_next = audit
        batch = worker.rollout(env, problems, seed=0)
        assert (batch.audit_record is not None) == audit
        return batch.rollout_stats

    audited = rollout(audit=True)
    assert worker.engine._session is session  # built its own, freed it
    assert audited["rollout/decode_steps"] > 0 and not worker.audit_next
    after = rollout(audit=False)
    assert worker.engine._session is session
    assert session.loop.graph_steps == after["rollout/decode_steps"] - 1  # every decode step a replay


def test_keeping_sessions_is_a_trace_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact", keep_decode_graph=False),
                          rollout=RolloutConfig(prompts_per_step=2), warmup_steps=0)
    keep_sessions(monkeypatch, module.worker.engine)
    assert isinstance(module.worker.engine, Engine) and not module.worker.engine._keeps_decode_graphs()


def _trained(kind: str) -> object:
    """A small real `tokenizers` model: sentencepiece-style (Metaspace, as Mixtral's) or byte-level BPE (as Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["the answer is 42 and the other answer is 17, 6 × 7 wörld"] * 50
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("kind", ["metaspace", "byte-level"])
def test_responses_decode_as_the_tokenizer_decodes_them_whole(tmp_path: Path, kind: str) -> None:
    """Word spaces of a sentencepiece tokenizer and UTF-8 characters spread over byte-level tokens survive; ids past
    the tokenizer's vocabulary read as '?', stop ids (eos, generation_config.json's) as nothing."""
    from trace_lightning.model.tokenizer import HFTokenizer

    tok = _trained(kind)
    tok.save(str(tmp_path / "tokenizer.json"))
    other_end = tok.token_to_id("<s>")  # a second end-of-generation id, as Qwen's generation_config.json lists
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [other_end]}))
    module = PolicyModule(trace=TraceConfig(method="trace_compact"), rollout=RolloutConfig(prompts_per_step=2),
                          warmup_steps=0)
    worker = module.worker
    worker.tokenizer = HFTokenizer(tmp_path)
    text = "the answer is 42, 6 × 7 wörld"
    ids = tok.encode(text).ids
    assert len(ids) > 6 and "".join(tok.decode([i]) for i in ids) != text  # token by token would lose it
    assert tok.decode(ids) == text
    eos, outside = worker.tokenizer.eos_id, worker.tokenizer.vocab_size
    assert list(worker.sampling_params(0).stop_token_ids) == [eos, other_end]
    assert worker.decode_response([*ids, eos]) == text == worker.decode_response([*ids, other_end])
    assert worker.decode_response([*ids[:3], outside, outside + 5, *ids[3:], eos]) == (
        tok.decode(ids[:3]) + "??" + tok.decode(ids[3:]))
