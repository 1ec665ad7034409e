"""trace.records_on_host: a record that would crowd the GPU streams to host memory; otherwise it stays where training
reads it in place."""

import dataclasses

import pytest
import torch

from trace_lightning.envs import make_env
from trace_lightning.lit import worker as worker_module
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.record_placement import FREE_SHARE, TOTAL_SHARE, record_goes_to_host

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")


def unread() -> int:
    raise AssertionError("free memory read where the choice does not depend on it")


def test_auto_streams_a_record_that_would_take_over_a_quarter_of_free_gpu_memory() -> None:
    card = (100 * 2**30, 1000 * 2**30)  # (free, total): only the free memory binds
    assert FREE_SHARE == 0.25
    assert record_goes_to_host("auto", GPU, 26 * 2**30, lambda: card)  # every layer's parity record at 256 x 768
    assert not record_goes_to_host("auto", GPU, 24 * 2**30, lambda: card)
    assert not record_goes_to_host("auto", GPU, 0, unread)


def test_auto_streams_a_record_that_would_take_over_a_twentieth_of_the_card() -> None:
    """The 2026-12-06 H100 fit: medium-moe's parity records at 256 x 1024 tokens, 7.8 GB, were under a quarter of the
    free memory at the rollout and ran the training step out of memory."""
    h100 = (60 * 2**30, 80 * 2**30)
    assert TOTAL_SHARE == 0.05
    assert record_goes_to_host("auto", GPU, int(7.8e9), lambda: h100)
    assert not record_goes_to_host("auto", GPU, 3 * 2**30, lambda: h100)  # small-moe's fit: stays where it is read


def test_an_explicit_setting_and_a_cpu_are_not_measured() -> None:
    assert record_goes_to_host(True, GPU, 1, unread) and record_goes_to_host(True, CPU, 1, unread)
    assert not record_goes_to_host(False, GPU, 2**40, unread)
    assert not record_goes_to_host("auto", CPU, 2**40, unread)  # a CPU's record is in host memory already


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_other_values_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="trace.records_on_host must be true, false or auto"):
        TraceConfig(records_on_host=value)  # type: ignore[arg-type]


def test_the_worker_asks_once_per_shape_with_the_engines_planned_record(monkeypatch: pytest.MonkeyPatch) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"), rollout=RolloutConfig(prompts_per_step=2),
                          warmup_steps=0)
    worker, env = module.worker, make_env("arithmetic", size=20)
    worker.record_layers = list(range(worker.engine.config.n_layers))
    asked = []

    def choose(setting: object, device: torch.device, record_bytes: int, memory: object) -> bool:
        asked.append(record_bytes)
        return True

    monkeypatch.setattr(worker_module, "record_goes_to_host", choose)
    problems = env.sample(2, seed=0)
    prompts = worker.group_prompts(problems)
    spec = worker.capture_spec(prompts)
    assert spec is not None and spec.stream_to_host
    max_len = max(len(p) for p in prompts) + worker.rollout_cfg.max_new_tokens
    on_device = dataclasses.replace(spec, stream_to_host=False)  # the record as it would be kept on the device
    assert asked == [worker.engine.memory_plan(len(prompts), max_len, on_device).records] and asked[0] > 0
    batch = worker.rollout(env, problems, seed=0)  # the same shape: decided already
    assert len(asked) == 1 and batch.rollout_stats["rollout/records_on_host"] == 1.0
    assert batch.record is not None
    assert worker.capture_spec().stream_to_host is False  # no prompts (a multi-turn live batch): on the device
