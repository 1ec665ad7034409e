"""The rollout worker's engine follows the policy module's device (Lightning moves the module after building it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trace_lightning.lit import worker as worker_module
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.policy import PolicyModule


class EngineOnAnyDevice:
    """Stands in for Engine where the real one cannot run (the meta device): keeps where it was built."""

    built: list[EngineOnAnyDevice] = []

    def __init__(self, model: torch.nn.Module, precision: Any, **kwargs: Any) -> None:
        self.device = next(model.parameters()).device
        self.model, self.policy_version = model, 0
        EngineOnAnyDevice.built.append(self)


def _module() -> PolicyModule:
    return PolicyModule(trace=TraceConfig(method="trace_compact"), rollout=RolloutConfig(prompts_per_step=2),
                        warmup_steps=0)


def test_the_engine_is_built_on_first_use_from_the_policy_as_it_is_then() -> None:
    module = _module()
    assert module.worker._engine is None  # nothing is converted at construction, on whatever device
    with torch.no_grad():
        module.policy.tok_embeddings.weight.add_(1.0)  # e.g. a checkpoint loaded after construction
    engine = module.worker.engine
    assert engine.device == module.device == torch.device("cpu")
    assert module.worker.engine is engine  # not rebuilt while the policy stays put
    expected = module.policy.tok_embeddings.weight.bfloat16()  # the rollout computes in bf16
    assert torch.equal(engine.model.tok_embeddings.weight, expected)


def test_the_engine_follows_a_module_move(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "Engine", EngineOnAnyDevice)
    EngineOnAnyDevice.built.clear()
    module = _module()
    first = module.worker.engine
    first.policy_version = 7
    module.to("meta")  # what Lightning's strategy does with the real device
    moved = module.worker.engine
    assert [e.device.type for e in EngineOnAnyDevice.built] == ["cpu", "meta"]
    assert moved.device == torch.device("meta") and moved.policy_version == 7
    assert all(p.device.type == "meta" for p in moved.model.parameters())
    assert moved.model is not module.policy  # a copy: the trainer's parameters stay the trainer's
