"""Records reach training as the engine's packed device tensor: no per-sequence record objects on the hot path,
the same training as through the bytes transport, and a bad record stops the fit naming what is wrong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from trace_lightning.guidance import BatchRecord, ModelIdentity, QuantRecord
from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import (
    CacheExchange,
    DepthSelectiveCompaction,
    MismatchMonitor,
    RecordRefused,
    WeightSync,
)
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule


class Seen(L.Callback):
    """Each RL step's loss and the batch record training got (after CacheExchange, which runs first)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.records: list[BatchRecord] = []
        self.refills: list[float | None] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch) and batch.record is not None:
            self.records.append(batch.record)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch):
            self.losses.append(float(outputs["loss"]))
            self.refills.append(batch.rollout_stats.get("rollout/refills"))


def _fit(tmp_path: Path, transport: str, *extra: L.Callback, sites: list[str] | None = None,
         max_batch: int | None = None, on_host: bool = False, prefill_chunk: int | None = None,
         problem_workers: int = 0, scan: str = "auto") -> Seen:
    torch.manual_seed(0)
    module = PolicyModule(trace=TraceConfig(method="trace_compact", audit_every=2, sites=sites,
                                            records_on_host=on_host),
                          rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3,
                                                max_batch=max_batch, prefill_chunk=prefill_chunk),
                          warmup_steps=1, cpu_threads=1)
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[*extra, WeightSync(), CacheExchange(transport, scan), DepthSelectiveCompaction(),
                                   MismatchMonitor(heatmap=False), seen])
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=8, eval_size=8,
                                                problem_workers=problem_workers))
    return seen


def test_device_records_train_exactly_as_records_sent_as_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    through_bytes = _fit(tmp_path / "bytes", "bytes")

    def no_sequence_records(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a per-sequence QuantRecord was built on the device transport's hot path")

    monkeypatch.setattr(QuantRecord, "__init__", no_sequence_records)
    on_device = _fit(tmp_path / "device", "device")
    assert len(on_device.losses) == 3 and on_device.losses == through_bytes.losses
    for ours, theirs in zip(on_device.records, through_bytes.records, strict=True):
        assert ours.layout == theirs.layout and ours.mode == "parity"
        assert torch.equal(ours.data, theirs.data) and torch.equal(ours.routes, theirs.routes)
        assert torch.equal(ours.valid, theirs.valid)


class Corrupt(L.Callback):
    """Writes a NaN E4M3 block scale (or `byte`) into the first RL batch's record, as a bad copy or kernel would."""

    def __init__(self, byte: int = 0x7F) -> None:
        self.byte = byte

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch) and batch.record is not None:
            slot = batch.record.layout.slots[-1]
            batch.record.data[0, 0, slot.offset + slot.global_bytes] = self.byte


def test_a_corrupt_device_record_stops_the_fit_naming_step_and_site(tmp_path: Path) -> None:
    with pytest.raises(RecordRefused, match=r"step 1: layer 3 site v: 1 NaN, zero or negative E4M3 block scale"):
        _fit(tmp_path, "device", Corrupt())


class Weights(L.Callback):
    """The policy's weights as each step starts (what a refused step must leave as they were), and the module."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.module: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.before = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
        self.module = module


def test_a_corrupt_record_scanned_beside_the_step_is_refused_before_its_optimizer_step(tmp_path: Path) -> None:
    """scan="beside" (the default where a GPU trains from a host record): the step trains while a host thread
    reads every scale, and the refusal comes before the update, with the inline scan's message. A zero scale
    (unlike a NaN one) leaves the forward finite, so only the scan can stop this step."""
    weights = Weights()
    with pytest.raises(RecordRefused, match=r"step 1: layer 3 site v: 1 NaN, zero or negative E4M3 block scale"):
        _fit(tmp_path, "device", weights, Corrupt(0x00), scan="beside")
    after = weights.module.policy.state_dict()
    assert weights.module.global_step == 1 and weights.module.pending_checks == []
    assert all(torch.equal(after[k], v) for k, v in weights.before.items())


def test_a_record_scanned_beside_the_step_trains_as_one_scanned_before_it(tmp_path: Path) -> None:
    inline = _fit(tmp_path / "inline", "device", on_host=True, scan="inline")
    beside = _fit(tmp_path / "beside", "device", on_host=True, scan="beside")
    assert len(beside.losses) == 3 and beside.losses == inline.losses


def test_unknown_transport_or_scan_is_refused() -> None:
    with pytest.raises(ValueError, match="'device' or 'bytes'"):
        CacheExchange("shm")
    with pytest.raises(ValueError, match="'auto', 'inline' or 'beside'"):
        CacheExchange(scan="later")


def test_trace_sites_limit_what_is_recorded_on_every_step(tmp_path: Path) -> None:
    seen = _fit(tmp_path, "device", sites=["moe_down", "v"])
    assert len(seen.records) == 3  # an audit step (full codes of everything, compacted) and two plain ones
    for record in seen.records:
        assert {site for _, site in record.layout.keys} == {"moe_down", "v"} and record.mode == "parity"
    with pytest.raises(ValueError, match="trace.sites: unknown sites"):
        TraceConfig(sites=["q"])


def test_continuous_batching_rollouts_train_with_whole_records(tmp_path: Path) -> None:
    """rollout.max_batch: 3 slots for 8 rollouts a step; every record row the training window needs is there."""
    seen = _fit(tmp_path, "device", max_batch=3)
    assert len(seen.losses) == 3 and all(torch.isfinite(torch.tensor(seen.losses)))
    assert seen.refills == [5.0] * 3  # 8 rollouts through 3 slots: 5 refills a step
    for record in seen.records:
        record.check()
        assert record.valid.shape[0] == 8 and bool(record.valid[:, 0].all())
    with pytest.raises(ValueError, match="rollout.max_batch must be an integer >= 1"):
        RolloutConfig(max_batch=0)


def test_records_streamed_to_the_host_train_exactly_as_records_kept_on_the_device(tmp_path: Path) -> None:
    kept, streamed = _fit(tmp_path / "kept", "device"), _fit(tmp_path / "host", "device", on_host=True)
    assert streamed.losses == kept.losses
    for ours, theirs in zip(streamed.records, kept.records, strict=True):
        assert ours.layout == theirs.layout and torch.equal(ours.data, theirs.data)


def test_records_are_checked_against_the_weights_last_synced_without_gathering_them_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WeightSync fingerprints the buckets it sends; CacheExchange checks records against that (under FSDP a fresh
    fingerprint would all-gather the weights a second time each step), and it is the trainer's own weights'."""
    calls: list[int] = []
    of = ModelIdentity.of

    def counted(config: Any, named: dict[str, torch.Tensor]) -> ModelIdentity:
        calls.append(1)
        return of(config, named)

    class Compare(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            if isinstance(batch, TrainBatch):
                fresh = of(module.policy.config, module.named_weights_for_sync())
                assert module.synced_identity == fresh and batch.record.model_id == fresh.fingerprint

    monkeypatch.setattr(ModelIdentity, "of", staticmethod(counted))
    seen = _fit(tmp_path, "device", Compare())
    assert len(seen.records) == 3 and calls == []


def test_chunked_prefill_trains_as_one_forward(tmp_path: Path) -> None:
    """rollout.prefill_chunk reaches the engine, and a fit's records and losses are those of one-forward prefills
    (tests/rollout/test_prefill_chunks.py has the sequences)."""
    whole, chunked = _fit(tmp_path / "whole", "device"), _fit(tmp_path / "chunked", "device", prefill_chunk=2)
    torch.testing.assert_close(torch.tensor(chunked.losses), torch.tensor(whole.losses), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(chunked.records, whole.records, strict=True):
        assert torch.equal(ours.data[ours.valid], theirs.data[theirs.valid])
    assert PolicyModule(rollout=RolloutConfig(prefill_chunk=2)).worker.engine.prefill_chunk == 2
    with pytest.raises(ValueError, match="rollout.prefill_chunk must be an integer >= 1"):
        RolloutConfig(prefill_chunk=0)


def test_problems_built_ahead_by_loader_workers_train_as_problems_built_in_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.problem_workers: two loader processes build the steps' problems (each every other step), none is built
    in the training process, and the fit is the one that builds them itself."""
    in_step = _fit(tmp_path / "in_step", "device")
    trainer_pid, build = os.getpid(), RLDataModule._problems

    def elsewhere(self: RLDataModule, n: int, step: int) -> list[Any]:
        assert os.getpid() != trainer_pid, f"step {step}'s problems were built in the training process"
        return build(self, n, step)

    monkeypatch.setattr(RLDataModule, "_problems", elsewhere)
    ahead = _fit(tmp_path / "ahead", "device", problem_workers=2)
    assert len(ahead.losses) == 3 and ahead.losses == in_step.losses
    with pytest.raises(ValueError, match="data.problem_workers must be an integer >= 0"):
        RLDataModule(problem_workers=-1)
