"""An RL fit's rollouts keep one decode session; its audit rollouts (every layer's codes) leave it in place."""

from __future__ import annotations

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
