"""A few-step fit on CPU: logged scalars exist and are finite, resume reproduces the next step, NaN stops it."""

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import WeightSync, default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import NonFiniteError, PolicyModule
from trace_lightning.lit.tensorboard import RunLogger
from trace_lightning.rl import MISMATCH_KEYS, mismatch_metrics


def _callback_states(trainer: L.Trainer) -> dict[str, Any]:
    """Every callback's checkpointed state, what DepthSelectiveCompaction set on the worker, and the versions."""
    states: dict[str, Any] = {type(cb).__name__: cb.state_dict() for cb in trainer.callbacks
                              if not isinstance(cb, StepRecorder)}
    worker = trainer.lightning_module.worker
    states["worker"] = (list(worker.record_layers), worker.audit_next, worker.policy_version)
    states["policy_version"] = trainer.lightning_module.policy_version
    return states


class StepRecorder(L.Callback):
    """Keeps each RL step's loss, reward and k3_kl, every logged scalar name, and the callbacks' state as each
    step starts."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.names: set[str] = set()
        self.states: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.states[trainer.global_step] = _callback_states(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.names |= set(trainer.callback_metrics)
        if isinstance(batch, TrainBatch):
            k3 = mismatch_metrics(outputs["logprobs"], batch.rollout_logprobs, batch.response_mask)["mismatch/k3_kl"]
            self.steps[trainer.global_step - 1] = {  # global_step already counts this step
                "loss": float(outputs["loss"]),
                "reward": float(batch.rewards.mean()),
                "k3_kl": float(k3),
            }


def _fit(tmp_path: Path, max_steps: int, method: str = "trace_compact", ckpt: str | None = None,
         save: bool = False, audit_every: int = 2, layers: str | None = None,
         micro_batch_size: int | None = None) -> tuple[PolicyModule, StepRecorder, L.Trainer]:
    module = PolicyModule(
        trace=TraceConfig(method=method, audit_every=audit_every, layers=layers),
        rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
        warmup_steps=2,
        cpu_threads=1,
        micro_batch_size=micro_batch_size,
    )
    data = RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8)
    recorder = StepRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[*default_callbacks(), recorder],
        logger=RunLogger(str(tmp_path), name="fit"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(tmp_path / "mid.ckpt")
    return module, recorder, trainer


def test_cpu_threads_hold_for_the_run_only(tmp_path: Path) -> None:
    """PolicyModule(cpu_threads=1) runs single-threaded and gives the process its thread count back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen = []
        module = PolicyModule(rollout=RolloutConfig(max_new_tokens=2), cpu_threads=1)
        module.predict_step = lambda batch, batch_idx: seen.append(torch.get_num_threads())
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_predict_batches=1)
        trainer.predict(module, datamodule=RLDataModule(eval_size=2))
        assert seen == [1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_short_fit_logs_finite_mismatch_and_agreement_metrics(tmp_path: Path) -> None:
    module, recorder, _ = _fit(tmp_path, max_steps=5)
    assert sorted(recorder.steps) == [2, 3, 4]
    for key in (*MISMATCH_KEYS, "reward/mean", "train/loss", "guidance/bytes_per_token", "moe/route_agreement",
                "agreement/own_codes", "agreement/used_values", "rollout/tokens_per_s", "train/sft_loss",
                "rollout/prefill_s", "rollout/graph_capture_s"):
        assert key in recorder.names, key
    for step in recorder.steps.values():
        assert all(math.isfinite(v) for v in step.values())
    assert module.policy_version == 5
    assert module.worker.policy_version == 5


def test_micro_batches_give_the_whole_batch_update(tmp_path: Path) -> None:
    """micro_batch_size 3 (uneven parts of the 8-row batches) accumulates the same gradients as one pass: the same
    samples, rewards and metrics, and weights equal up to float summation order, through SFT and RL steps."""
    runs = {}
    for size in (None, 3):
        torch.manual_seed(0)
        runs[size] = _fit(tmp_path / str(size), max_steps=4, micro_batch_size=size)
    (whole, whole_steps, _), (parts, part_steps, _) = runs[None], runs[3]
    assert sorted(part_steps.steps) == sorted(whole_steps.steps) == [2, 3]
    for step, metrics in whole_steps.steps.items():
        assert part_steps.steps[step]["reward"] == metrics["reward"]
        for key in ("loss", "k3_kl"):
            assert part_steps.steps[step][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-9), (step, key)
    # AdamW turns a summation-order difference in a near-zero gradient into up to a fraction of its step (lr 3e-3
    # in warm-up, 1e-3 after): within 1e-4, where four steps move the weights by ~1e-2.
    for name, value in whole.policy.state_dict().items():
        torch.testing.assert_close(parts.policy.state_dict()[name], value, rtol=0, atol=1e-4, msg=name)
    with pytest.raises(ValueError, match="micro_batch_size"):
        PolicyModule(micro_batch_size=0)


@pytest.mark.slow  # three fits, twice
@pytest.mark.parametrize("audit_every", [2, 3])  # 3: the resumed step is no audit step (a resume once audited it)
def test_resume_continues_exactly_as_the_uninterrupted_run(tmp_path: Path, audit_every: int) -> None:
    """Step 4 (the resumed step) and step 5 (one past it, after the restored optimizer's update) match the
    uninterrupted run exactly, as do the callbacks' state and policy version as each starts, and at the end the
    weights and the optimizer state. Step 4's forward alone would not notice a dropped optimizer state; step 5
    and the weights do. The auto layer policy makes the compaction callback's audit ranking matter."""
    runs = {}
    for name, steps, ckpt in (("full", 6, None), ("first", 4, None), ("resumed", 6, "first/mid.ckpt")):
        torch.manual_seed(0)
        runs[name] = _fit(tmp_path / name, max_steps=steps, save=name == "first", audit_every=audit_every,
                          layers="auto", ckpt=ckpt and str(tmp_path / ckpt))
    (full_module, full, full_trainer), (module, resumed, trainer) = runs["full"], runs["resumed"]
    assert sorted(resumed.steps) == sorted(resumed.states) == [4, 5]
    assert full.states[4]["DepthSelectiveCompaction"]["layer_agreement"]  # an audit ranking to carry over
    for step in (4, 5):
        assert resumed.states[step] == full.states[step], step
        assert resumed.steps[step] == full.steps[step], step
    assert module.policy_version == full_module.policy_version == 6
    assert _callback_states(trainer) == _callback_states(full_trainer)
    for name, value in full_module.policy.state_dict().items():
        assert torch.equal(module.policy.state_dict()[name], value), name
    ours, theirs = trainer.optimizers[0].state_dict()["state"], full_trainer.optimizers[0].state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index, state in theirs.items():
        for key, value in state.items():
            assert torch.equal(ours[index][key], value), (index, key)


class PoisonTrainingWeights(L.Callback):
    """NaN into the trainer's copy of one layer's `wo` only, after the worker holds good weights; the weights as
    the step started kept in `before`."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.before: dict[str, torch.Tensor] = {}
        self.module: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
        self.module = module
        with torch.no_grad():
            module.policy.layers[self.layer].attn.wo.weight.fill_(float("nan"))


def _poisoned_fit(poison: PoisonTrainingWeights, micro_batch_size: int | None = None) -> PolicyModule:
    module = PolicyModule(rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=2),
                          warmup_steps=0, cpu_threads=1, micro_batch_size=micro_batch_size)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        callbacks=[*default_callbacks(), poison],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=4, eval_size=4))
    return module


def test_non_finite_activation_stops_with_step_layer_and_site(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"step 0: .*layer \d+.*site"):
        _poisoned_fit(PoisonTrainingWeights(1))


def test_a_non_finite_micro_batch_stops_the_step_before_its_update(tmp_path: Path) -> None:
    """The step's finite checks are read once, after its last micro-batch: the first bad value in micro-batch
    order is named (the first site after the poisoned `wo`), and the optimizer step never runs."""
    poison = PoisonTrainingWeights(2)
    with pytest.raises(NonFiniteError, match=r"step 0: non-finite activation at layer 2, site moe_in"):
        _poisoned_fit(poison, micro_batch_size=1)
    module = poison.module
    after = module.policy.state_dict()
    unchanged = [k for k in poison.before if "layers.2.attn.wo" not in k]
    assert module._finite_checks == [] and all(torch.equal(after[k], poison.before[k]) for k in unchanged)


def test_predict_from_a_checkpoint_samples_with_its_weights(tmp_path: Path) -> None:
    trained, _, _ = _fit(tmp_path, max_steps=3, save=True)
    module = PolicyModule(rollout=RolloutConfig(max_new_tokens=3), cpu_threads=1)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_predict_batches=1)
    rows = trainer.predict(module, datamodule=RLDataModule(eval_size=4), ckpt_path=str(tmp_path / "mid.ckpt"))
    assert module.worker.policy_version == trained.policy_version == 3
    assert module.worker.weight_checksums() == trained.worker.weight_checksums()
    assert rows and set(rows[0][0]) == {"prompt", "response", "answer"}


def test_weight_sync_audit_fails_loudly_when_rollout_bytes_differ() -> None:
    from trace_lightning.lit.callbacks import WeightSync, WeightSyncError

    module = PolicyModule(cpu_threads=1)
    named = module.named_weights_for_sync()
    module.worker.sync(named, 0)
    assert WeightSync.audit(module, named) > 0
    stale = {k: v.clone() for k, v in named.items()}
    key = next(k for k in stale if k.endswith("attn.wo.weight"))
    stale[key] = stale[key] * 1.5  # the worker now holds other weights than the trainer audits against
    module.worker.sync(stale, 1)
    with pytest.raises(WeightSyncError, match="attn.wo"):
        WeightSync.audit(module, named)


def _scalars(run: Path) -> dict[str, list[int]]:
    acc = EventAccumulator(str(next(run.glob("events.out.tfevents.*"))), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]} | {
        "__images__": acc.Tags()["images"], "__tensors__": acc.Tags()["tensors"]}


def test_fit_logs_each_metric_only_at_the_steps_it_was_measured(tmp_path: Path) -> None:
    _fit(tmp_path, max_steps=6)  # steps 0-1 warm start, 2-5 RL, audits at steps 2 and 4 (audit_every=2)
    logged = _scalars(tmp_path / "fit" / "version_0")
    assert logged["train/sft_loss"] == [0, 1]  # not re-logged during RL
    assert logged["reward/mean"] == logged["mismatch/k3_kl"] == [2, 3, 4, 5]
    assert logged["reward/score_timeouts"] == logged["reward/score_errors"] == logged["time/score_s"] == [2, 3, 4, 5]
    assert logged["agreement/one_minus_own_codes"] == logged["agreement/one_minus_used_values"] == [2, 4]
    assert not any(tag.startswith("agreement_per_layer/") for tag in logged)  # each layer is a sub-run
    layer = _scalars(tmp_path / "fit" / "version_0" / "layer_03")
    assert layer["agreement_per_layer/one_minus_own_codes/moe_down"] == [2, 4]  # audit steps only
    assert "mismatch_bf16/k3_kl" not in logged
    reference = _scalars(tmp_path / "fit" / "version_0" / "bf16_reference")  # the same tags in a sub-run
    assert reference["mismatch/k3_kl"] == reference["mismatch/one_minus_ess"] == [2, 3, 4, 5]
    assert "epoch" not in logged and "hp_metric" not in logged
    assert "policy/clip_frac" not in logged  # 0 by construction with one update per batch
    assert logged["__images__"] == ["agreement/layer_x_site"]
    assert "custom_scalars__config__" in logged["__tensors__"]


@pytest.mark.slow  # the Triton kernels through the interpreter on a CPU: about two minutes
def test_fit_through_the_triton_engine_syncs_exact_bytes_and_guides_exactly(tmp_path: Path) -> None:
    """The GPU fit's path on any machine: the rollout engine runs the Triton kernels (interpreted without CUDA),
    the trainer its own quantizers. The weight audit runs at every sync (it raises on one differing byte). On the
    audit step (full codes recorded) guided value agreement is 1.0; on the others the kernel-written parity bits
    guide, and k3_kl stays at trace_compact's level: measured 0.6-1.6e-6 against fp4_qat's 2.5-3.1e-4 on this run;
    with the record kernel's parity bits swapped, 1.3-3.9e-3. Routes are replayed, as conf/sim.yaml does (without,
    a rare router flip sends a token to other experts: value agreement 0.9988 here)."""
    module = PolicyModule(
        trace=TraceConfig(backend="triton", audit_every=2, route_replay=True),
        rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=3),
        warmup_steps=1,
        cpu_threads=1,
    )
    callbacks = [WeightSync(audit_every=1), *default_callbacks()[1:]]  # the FP4 byte audit at every sync
    trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=callbacks, logger=RunLogger(str(tmp_path), "fit"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=1)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=4, eval_size=4))
    assert module.worker.engine.ops.__name__ == "trace_lightning.kernels"
    acc = EventAccumulator(str(next((tmp_path / "fit" / "version_0").glob("events.out.tfevents.*"))))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("agreement/one_minus_used_values")] == [(2, 0.0)]
    assert 0.0 < acc.Scalars("agreement/one_minus_own_codes")[0].value < 0.5  # unguided rounding differs
    k3 = {e.step: e.value for e in acc.Scalars("mismatch/k3_kl")}
    assert sorted(k3) == [1, 2] and max(k3.values()) < 2e-5, k3  # step 1 guided by parity, step 2 by codes


def test_validation_draws_from_the_held_out_env() -> None:
    """The data module evaluates on its env's held-out twin (reasoning-gym: the next `size` item seeds), and on the
    env itself where the task cannot split (guess_number)."""
    data = RLDataModule(env="countdown", env_kwargs={"size": 100, "seed": 2}, eval_size=4)
    assert (data.eval_env.seed, data.eval_env.size) == (102, 100)
    (batch,) = list(data.val_dataloader())
    training = {p.prompt for p in data.env.sample(100, seed=0)}  # the whole training pool
    assert len(batch) == 4 and not training & {p.prompt for p in batch}
    no_split = RLDataModule(env="guess_number")
    assert no_split.eval_env is no_split.env
