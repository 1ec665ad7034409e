"""Callbacks that own the side concerns of the RL loop: weight sync, record exchange, compaction, metrics."""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning as L
import torch
from torch import Tensor

from trace_lightning.guidance import RecordExchange, collate_records, layer_bytes_per_token, select_layers
from trace_lightning.guidance.identity import weights_fingerprint
from trace_lightning.guidance.record import ModelIdentity, format_name
from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.tensorboard import SITE_ORDER, agreement_heatmap, log_measured, write_layout
from trace_lightning.quant import parse_format
from trace_lightning.rl import MismatchMetric, mismatch_metrics
from trace_lightning.rollout import check_weight_checksums, fp4_weight_checksums
from trace_lightning.timing import device_time


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
        digests: dict[str, str] = {}
        sync_s = 0.0
        for bucket in module.weight_buckets(self.bucket_mb << 20):
            start = device_time(module.device)
            # the bucket's digests as the engine took them, in the same process from these very tensors: a second
            # pass here could only agree, and it cost a reduction per tensor and a host sync per bucket a step
            digests |= module.worker.sync(bucket, module.policy_version)
            sync_s += device_time(module.device) - start
            if audit:
                ours |= fp4_weight_checksums(bucket, module.fmt, config=module.policy.config)
        # what records must come from until the next sync (CacheExchange), taken from the buckets already gathered:
        # under FSDP recomputing it from the sharded weights would cost another all-gather a step
        config = module.policy.config
        module.synced_identity = ModelIdentity(weights_fingerprint(digests), config.n_layers, config.n_experts,
                                               config.top_k)
        if log:  # after the optimizer step: global_step already counts the step this sync follows
            log_measured(module, {"time/sync_s": sync_s}, module.global_step - 1)
        if audit:
            self.check(module, ours)
            self.check_ranks_agree(module, ours)

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


class RecordRefused(RuntimeError):
    """A rollout's record is stale, from another model or format, or holds values no rollout writes."""


class CacheExchange(L.Callback):
    """Hands each rollout's batch record to the training side, refusing stale, foreign or corrupt ones.

    The record arrives as the packed device tensor the engine wrote. With ``transport="device"`` it stays there
    and is checked in place (policy version, weights fingerprint, format, scale and route values) in one
    vectorized pass. With ``transport="bytes"`` every sequence's record is serialized with its checksum and
    loaded back, as a record crossing processes or machines would be (what ``guidance/exchange_bytes`` then
    counts is what would cross the network).
    """

    def __init__(self, transport: str = "device", scan: str = "auto") -> None:
        """
        Args:
            transport: "device" (check the rollout's record where it is) or "bytes" (per-sequence safetensors with a
                checksum, loaded and validated back).
            scan: when the device transport reads every scale and route of the record: "inline" before the training
                step, "beside" in a host thread while the step trains (the step waits for the verdict before its
                optimizer step, and a refused record stops the fit as inline), "auto" beside where the record is in
                host memory and training on a GPU (the long fit's 7.8 GB a step: 1.0-1.4 s on an H100's host),
                else inline.
        """
        if transport not in ("device", "bytes"):
            raise ValueError(f"CacheExchange transport must be 'device' or 'bytes', got {transport!r}")
        if scan not in ("auto", "inline", "beside"):
            raise ValueError(f"CacheExchange scan must be 'auto', 'inline' or 'beside', got {scan!r}")
        self.transport, self.scan = transport, scan
        self.exchange = RecordExchange()
        self._bytes_per_token: float | None = None
        self._scanner: ThreadPoolExecutor | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, TrainBatch) and batch.record is None and module.method.exact:
            # trace_exact records nothing: its zero bytes are logged, so its runs line up with the record methods'
            log_measured(module, {"guidance/exchange_bytes": 0.0, "guidance/bytes_per_token": 0.0}, module.global_step)
        if not isinstance(batch, TrainBatch) or batch.record is None:
            return
        model = getattr(module, "synced_identity", None)  # WeightSync's, from the weights it last synced
        if model is None:
            model = ModelIdentity.of(module.policy.config, module.named_weights_for_sync())
        start = time.perf_counter()
        if self.transport == "bytes":
            metrics = self._through_bytes(module, batch, model)
        else:
            metrics = self._in_place(module, batch.record, model, self._beside(module, batch.record))
        # Between the batch and the training step: in no other time/* part, so a slow check would hide in step_s
        # (a scan beside the step adds the time the step waits for it, logged when it settles).
        metrics["time/record_check_s"] = time.perf_counter() - start
        per_token = metrics.pop("guidance/bytes_per_token")  # bytes summed over ranks, the rest rank means
        sums = [key for key in metrics if key.endswith("_bytes")]
        log_measured(module, metrics, module.global_step, batch.tokens.shape[0], sums=sums)
        if per_token != self._bytes_per_token:  # changes only with the layer policy: drawn when it does
            self._bytes_per_token = per_token
            log_measured(module, {"guidance/bytes_per_token": per_token}, module.global_step, every_step=True)

    def _beside(self, module: Any, record: Any) -> bool:
        if not hasattr(module, "pending_checks") or self.scan == "inline":
            return False
        return self.scan == "beside" or (record.data.device.type == "cpu" and module.device.type == "cuda")

    def _in_place(self, module: Any, record: Any, model: ModelIdentity, beside: bool) -> dict[str, float]:
        start, step = time.perf_counter(), module.global_step
        try:
            if record.fmt != parse_format(module.fmt):
                raise ValueError(f"wrong format: record is {format_name(record.fmt)}, training uses {module.fmt}")
            record.check_identity(expected_version=module.policy_version, model=model)
            if not beside:
                record.check_values(model.n_experts)
        except ValueError as err:
            raise RecordRefused(f"step {step}: {err}") from err
        if beside:
            if self._scanner is None:
                self._scanner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-scan")
            scan = self._scanner.submit(record.check_values, model.n_experts)

            def settle() -> None:
                waited = time.perf_counter()
                try:
                    scan.result()
                except ValueError as err:
                    raise RecordRefused(f"step {step}: {err}") from err
                log_measured(module, {"time/record_scan_wait_s": time.perf_counter() - waited}, step)

            module.pending_checks.append(settle)
        tokens = max(int(record.valid.sum()), 1)
        return {"guidance/bytes_per_token": record.payload_bytes() / tokens,
                "guidance/exchange_bytes": float(record.nbytes),
                "guidance/exchange_ms": 1000 * (time.perf_counter() - start)}

    def _through_bytes(self, module: Any, batch: TrainBatch, model: ModelIdentity) -> dict[str, float]:
        self.exchange.reset_metrics()
        record = batch.record
        ticket = self.exchange.send([record.sequence(i) for i in range(record.valid.shape[0])])
        received = self.exchange.receive(ticket, expected_version=module.policy_version, fmt=module.fmt, model=model)
        batch.record = collate_records(received, pad_to=record.length).to(record.data.device)
        return self.exchange.metrics()


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

    def apply(self, module: Any) -> None:
        """Set the worker's recorded layers, and whether its next rollout audits, for the module's next step."""
        worker = module.worker
        config = worker.engine.config
        mode = module.method.guidance_mode or "parity"
        policy = self._policy(module)
        audit = self.layer_agreement or None
        if policy.startswith("auto") and audit is None:
            policy = "all"  # no audit yet: record everything until the first ranking exists
        costs = layer_bytes_per_token(config, module.fmt, mode, sites=module.trace.sites)
        layers = select_layers(policy, config.n_layers, costs, audit)
        worker.record_layers = layers if module.method.records else []
        every = module.trace.audit_every if self.audit_every is None else self.audit_every
        # trainer.global_step is the index of the next step to run (at fit start and after each step).
        worker.audit_next = bool(every) and module.global_step % every == 0 and module.method.rollout_fp4

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        # Not on_fit_start: a resumed fit has its global_step back only by now, and the first rollout comes after.
        self.apply(module)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = outputs.get("hook") if isinstance(outputs, dict) else None
        if hook is not None and getattr(hook, "agreement", None):
            self.layer_agreement = hook.layer_agreement()
        self.apply(module)

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
    """Logs the train-rollout discrepancy at the steps it is measured (docs/design.md, "Metrics").

    Every RL step: the mismatch metrics of training's logprobs against the rollout's (`mismatch/*`), rollout
    speed, and route agreement when routes are not replayed (replayed routes agree by construction). At audit
    steps (full records of every layer): how often training's own round-to-nearest codes equal the rollout's
    (`agreement/own_codes`, what an unguided forward would get), how often the values the training forward
    used equal the rollout's (`agreement/used_values`, what guidance achieves), per layer and site and as a
    layer x site heatmap. Every `bf16_reference_every` steps, the BF16 reference (`mismatch_bf16/*`): the
    mismatch a BF16 rollout of the same policy shows on the same tokens.
    """

    def __init__(self, heatmap: bool = True, bf16_reference_every: int | None = None, text_every: int = 25) -> None:
        """
        Args:
            heatmap: Draw the layer x site agreement heatmap at each audit step (TensorBoard IMAGES tab).
            bf16_reference_every: Steps between measurements of the BF16 reference (0: never); each costs two
                forward passes of the batch without gradient. None: by the policy's parameter count (every step
                below 2B parameters, one step in ceil(parameters / 1B) above, at most 50).
            text_every: Steps between decoded sample texts in TensorBoard (0: never).
        """
        if bf16_reference_every is not None and (isinstance(bf16_reference_every, bool)
                                                 or not isinstance(bf16_reference_every, int)
                                                 or bf16_reference_every < 0):
            raise ValueError(f"bf16_reference_every must be None or an integer >= 0, got {bf16_reference_every!r}")
        self.heatmap, self.bf16_reference_every, self.text_every = heatmap, bf16_reference_every, text_every
        self._reference: dict[str, Tensor] = {}

    def reference_every(self, module: Any) -> int:
        """Steps between BF16 references for this module's policy (the setting, or its parameter-count default)."""
        if self.bf16_reference_every is not None:
            return self.bf16_reference_every
        return default_bf16_reference_every(sum(p.numel() for p in module.policy.parameters()))

    def on_fit_start(self, trainer: L.Trainer, module: Any) -> None:
        shared = module.policy.config.n_shared_experts > 0
        write_layout(trainer, [site for site in SITE_ORDER if site != "shared_down" or shared])

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        # Before the optimizer step, so the reference scores the weights that sampled the batch.
        every = self.reference_every(module)
        due = isinstance(batch, TrainBatch) and bool(every) and trainer.global_step % every == 0
        self._reference = bf16_reference(module, batch) if due else {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, TrainBatch) or not isinstance(outputs, dict):
            return
        n, step = batch.tokens.shape[0], trainer.global_step - 1  # global_step already counts this step
        # Over every rank's tokens: the metric's sufficient statistics are summed across ranks in compute().
        mismatch = MismatchMetric().to(outputs["logprobs"].device)
        mismatch.update(outputs["logprobs"], batch.rollout_logprobs, batch.response_mask)
        metrics = {**batch.rollout_stats, **mismatch.compute()}
        if batch.routes is not None and not module.trace.route_replay:
            agree = route_agreement(outputs["routes"], batch.routes, batch.response_mask)
            metrics["moe/route_agreement"] = sum(agree) / len(agree)
        log_measured(module, metrics, step, n)
        hook = outputs.get("hook")
        audit = getattr(hook, "agreement", None) or {}
        log_measured(module, {**agreement_metrics(audit), **self._reference}, step, n, every_step=True)
        if trainer.is_global_zero:
            self._tensorboard(trainer, batch, audit, step)

    def _tensorboard(self, trainer: L.Trainer, batch: TrainBatch, audit: dict[tuple[int, str], Any],
                     step: int) -> None:
        experiment = getattr(trainer.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_text"):
            return
        if self.text_every and step % self.text_every == 0 and batch.samples:
            lines = [f"`{s['prompt']}` -> `{s['response']}` (reward {s['reward']:.2f})" for s in batch.samples]
            experiment.add_text("samples", "  \n".join(lines), step)
        if self.heatmap and audit:
            own = {key: s.code_agreement for key, s in audit.items()}
            used = {key: s.value_agreement for key, s in audit.items()}
            experiment.add_figure("agreement/layer_x_site", agreement_heatmap(own, used, step), step)


def agreement_metrics(audit: dict[tuple[int, str], Any]) -> dict[str, float]:
    """`agreement/{own_codes,used_values}` overall and `agreement_per_layer/...` per layer and site."""
    out: dict[str, float] = {}
    elements = own = used = 0
    for (layer, site), s in sorted(audit.items()):
        out[f"agreement_per_layer/own_codes/layer{layer}/{site}"] = s.code_agreement
        out[f"agreement_per_layer/used_values/layer{layer}/{site}"] = s.value_agreement
        elements, own, used = elements + s.elements, own + s.code_equal, used + s.value_equal
    if elements:
        out["agreement/own_codes"], out["agreement/used_values"] = own / elements, used / elements
    return out


@torch.no_grad()
def bf16_reference(module: Any, batch: TrainBatch) -> dict[str, Tensor]:
    """`mismatch_bf16/*`: the policy with BF16 weights against training's unquantized forward on the batch's tokens.

    The mismatch a BF16 rollout of the same policy would show: the floor that FP4 rollouts are compared to. Both
    sides run the trainer's own policy over the step's micro-batches (PolicyModule.unquantized_logprobs), the
    BF16 side with each module's weights cast as it runs: no second model, nothing to sync. Empty for methods
    that already roll out in BF16 (their `mismatch/*` is that floor).
    """
    if not module.method.rollout_fp4:
        return {}
    train = module.unquantized_logprobs(batch)
    rollout = module.unquantized_logprobs(batch, torch.bfloat16)
    metrics = mismatch_metrics(train, rollout, batch.response_mask)
    return {key.replace("mismatch/", "mismatch_bf16/"): value for key, value in metrics.items()}


def default_bf16_reference_every(n_parameters: int) -> int:
    """Steps between BF16 references by default: every step below 2B parameters, then one step in every
    ceil(parameters / 1B) (30 at 30B, capped at 50). Its two forwards without gradient cost about two thirds of a
    training step's compute, so large models measure it on a sample of steps."""
    return 1 if n_parameters < 2e9 else min(50, math.ceil(n_parameters / 1e9))


def default_callbacks() -> list[L.Callback]:
    return [WeightSync(), CacheExchange(), DepthSelectiveCompaction(), MismatchMonitor()]


__all__ = [
    "CacheExchange",
    "DepthSelectiveCompaction",
    "MismatchMonitor",
    "WeightSync",
    "WeightSyncError",
    "agreement_metrics",
    "bf16_reference",
    "default_bf16_reference_every",
    "default_callbacks",
    "route_agreement",
]
