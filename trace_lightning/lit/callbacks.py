"""Callbacks that own the side concerns of the RL loop: weight sync, record exchange, compaction, metrics."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import lightning as L
from torch import Tensor

from trace_lightning.guidance import (
    ModelIdentity,
    RecordExchange,
    collate_records,
    layer_bytes_per_token,
    select_layers,
)
from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.timing import device_time
from trace_lightning.rl import MismatchMetric
from trace_lightning.rollout import check_weight_checksums, fp4_weight_checksums


class WeightSyncError(RuntimeError):
    """The rollout's FP4 weight bytes differ from what the trainer's quantizer produces."""


class WeightSync(L.Callback):
    """After every optimizer step, stream the master weights to the worker, which re-quantizes them to FP4."""

    def __init__(self, audit_every: int = 10, bucket_mb: int = 256) -> None:
        """
        Args:
            audit_every: Every N syncs compare the worker's FP4 byte checksums with the trainer's own (0: never),
                and, with several ranks, every rank's checksums with rank 0's.
            bucket_mb: Size of the weight buckets streamed to the worker (under FSDP, one all-gather each).
        """
        self.audit_every, self.bucket_mb = audit_every, bucket_mb

    def _sync(self, module: Any, log: bool = True) -> None:
        audit = bool(self.audit_every) and module.policy_version % self.audit_every == 0 and module.method.rollout_fp4
        ours: dict[str, str] = {}
        sync_s = 0.0
        for bucket in module.weight_buckets(self.bucket_mb << 20):
            start = device_time(module.device)
            module.worker.sync(bucket, module.policy_version)
            sync_s += device_time(module.device) - start
            if audit:
                ours |= fp4_weight_checksums(bucket, module.fmt, config=module.policy.config)
        if log:
            module.log("time/sync_s", sync_s)
        if audit:
            self.check(module, ours)
            self.check_ranks_agree(module, ours)
            if log:
                module.log("sync/audited_tensors", float(len(ours)))

    @staticmethod
    def audit(module: Any, named: dict[str, Tensor]) -> int:
        """Compare both sides' FP4 weight checksums; returns how many tensors were compared."""
        ours = fp4_weight_checksums(named, module.fmt, config=module.policy.config)
        WeightSync.check(module, ours)
        return len(ours)

    @staticmethod
    def check(module: Any, ours: dict[str, str]) -> None:
        """The worker's FP4 bytes are the trainer's quantization of its own master weights."""
        try:
            check_weight_checksums(ours, module.worker.weight_checksums())
        except ValueError as err:
            raise WeightSyncError(f"policy version {module.policy_version}: {err}") from err

    @staticmethod
    def check_ranks_agree(module: Any, ours: dict[str, str]) -> None:
        """Every data-parallel rank holds rank 0's weights (DDP's replicas must stay identical); all ranks raise."""
        strategy = module.trainer.strategy
        digest = hashlib.sha256(json.dumps(ours, sort_keys=True).encode()).hexdigest()
        agree = strategy.reduce_boolean_decision(digest == strategy.broadcast(digest, src=0), all=True)
        if not agree:
            raise WeightSyncError(f"policy version {module.policy_version}: the ranks' FP4 weights differ from "
                                  "rank 0's (the data-parallel replicas have diverged)")

    def on_fit_start(self, trainer: L.Trainer, module: Any) -> None:
        self._sync(module, log=False)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        module.policy_version += 1
        self._sync(module)


class CacheExchange(L.Callback):
    """Moves each rollout's QuantRecords to the training side as bytes, refusing stale or corrupt ones."""

    def __init__(self) -> None:
        self.exchange = RecordExchange()

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, TrainBatch):
            return
        width = batch.tokens.shape[1] - 1
        self.exchange.reset_metrics()
        if batch.records:
            ticket = self.exchange.send(batch.records)
            model = ModelIdentity.of(module.policy.config, module.named_weights_for_sync())
            received = self.exchange.receive(ticket, expected_version=module.policy_version, fmt=module.fmt,
                                             model=model)
            batch.record = collate_records(received, pad_to=width)
            for key, value in self.exchange.metrics().items():  # bytes summed over ranks, the rest rank means
                module.log(key, value, batch_size=batch.tokens.shape[0], sync_dist=True,
                           reduce_fx="sum" if key.endswith("_bytes") else "mean")
        if batch.audit_records:
            batch.audit_record = collate_records(batch.audit_records, pad_to=width)


class DepthSelectiveCompaction(L.Callback):
    """Chooses which layers the rollout records; `auto` re-ranks layers from periodic full-record audits."""

    def __init__(self, policy: str | None = None, audit_every: int | None = None) -> None:
        """
        Args:
            policy: Layer policy (all, none, last:K, deep:F, budget:BYTES, auto, auto:BYTES); None: the method's.
            audit_every: Steps between audits with full records of every layer; None: trace.audit_every.
        """
        self.policy, self.audit_every = policy, audit_every
        self.layer_agreement: dict[int, float] = {}
        """Code agreement per layer from the latest audit (input of the auto policy)."""

    def _policy(self, module: Any) -> str:
        return self.policy or module.trace.layers or module.method.default_layers

    def _apply(self, module: Any) -> None:
        worker = module.worker
        config = worker.engine.config
        mode = module.method.guidance_mode or "parity"
        policy = self._policy(module)
        audit = self.layer_agreement or None
        if policy.startswith("auto") and audit is None:
            policy = "all"  # no audit yet: record everything until the first ranking exists
        layers = select_layers(policy, config.n_layers, layer_bytes_per_token(config, module.fmt, mode), audit)
        worker.record_layers = layers if module.method.records else []
        every = module.trace.audit_every if self.audit_every is None else self.audit_every
        # trainer.global_step is the index of the next step to run (at fit start and after each step).
        worker.audit_next = bool(every) and module.global_step % every == 0 and module.method.rollout_fp4

    def on_fit_start(self, trainer: L.Trainer, module: Any) -> None:
        self._apply(module)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = outputs.get("hook") if isinstance(outputs, dict) else None
        if hook is not None and getattr(hook, "agreement", None):
            self.layer_agreement = hook.layer_agreement()
        self._apply(module)

    def state_dict(self) -> dict[str, Any]:
        return {"layer_agreement": dict(self.layer_agreement)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.layer_agreement = {int(k): float(v) for k, v in state_dict.get("layer_agreement", {}).items()}


def route_agreement(train_routes: list[Tensor], rollout_routes: list[Tensor], mask: Tensor) -> list[float]:
    """Per layer: fraction of response positions whose top-k expert set is the same on both sides."""
    out = []
    for ours, theirs in zip(train_routes, rollout_routes, strict=True):
        same = (ours.sort(dim=-1).values == theirs.to(ours.device).sort(dim=-1).values).all(dim=-1)  # (B, T)
        out.append(float(same[mask].float().mean()) if bool(mask.any()) else 1.0)
    return out


class MismatchMonitor(L.Callback):
    """Logs the mismatch metrics of DESIGN.md section 7, per-layer agreements, a figure and decoded samples."""

    def __init__(self, figure_every: int = 25, text_every: int = 25) -> None:
        """
        Args:
            figure_every: Steps between per-layer agreement figures in TensorBoard.
            text_every: Steps between decoded sample texts in TensorBoard.
        """
        self.figure_every, self.text_every = figure_every, text_every

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, TrainBatch) or not isinstance(outputs, dict):
            return
        n = batch.tokens.shape[0]
        # Over every rank's tokens: the metric's sufficient statistics are summed across ranks in compute().
        mismatch = MismatchMetric().to(outputs["logprobs"].device)
        mismatch.update(outputs["logprobs"], batch.rollout_logprobs, batch.response_mask)
        metrics = mismatch.compute()
        for key, value in batch.rollout_stats.items():
            module.log(key, value, batch_size=n, sync_dist=True)  # rank means
        for key, value in metrics.items():
            module.log(key, value, batch_size=n)
        layer_stats: dict[str, list[float]] = {}
        if batch.routes is not None:
            agree = route_agreement(outputs["routes"], batch.routes, batch.response_mask)
            module.log("moe/route_agreement", sum(agree) / len(agree), batch_size=n, sync_dist=True)
            layer_stats["route"] = agree
        hook = outputs.get("hook")
        if hook is not None and getattr(hook, "agreement", None):
            for key, value in hook.metrics().items():
                module.log(key, value, batch_size=n, sync_dist=True)
            layer_stats["code"] = list(hook.layer_agreement().values())
        if trainer.is_global_zero:
            self._tensorboard(trainer, module, batch, layer_stats)

    def _tensorboard(
        self, trainer: L.Trainer, module: Any, batch: TrainBatch, layer_stats: dict[str, list[float]]
    ) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_text"):
            return
        step = trainer.global_step
        if self.text_every and step % self.text_every == 0 and batch.samples:
            lines = [f"`{s['prompt']}` -> `{s['response']}` (reward {s['reward']:.2f})" for s in batch.samples]
            experiment.add_text("samples", "  \n".join(lines), step)
        if self.figure_every and step % self.figure_every == 0 and layer_stats:
            experiment.add_figure("agreement_per_layer", agreement_figure(layer_stats), step)


def agreement_figure(layer_stats: dict[str, list[float]]) -> Any:
    """A bar chart of per-layer agreements (route, code) for TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.8 / max(len(layer_stats), 1)
    for i, (name, values) in enumerate(layer_stats.items()):
        ax.bar([j + i * width for j in range(len(values))], values, width=width, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("agreement")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def default_callbacks() -> list[L.Callback]:
    return [WeightSync(), CacheExchange(), DepthSelectiveCompaction(), MismatchMonitor()]


__all__ = [
    "CacheExchange",
    "DepthSelectiveCompaction",
    "MismatchMonitor",
    "WeightSync",
    "WeightSyncError",
    "default_callbacks",
    "route_agreement",
]
