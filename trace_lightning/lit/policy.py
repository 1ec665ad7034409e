"""The policy LightningModule: master weights, the training forward per method, and the RL step.

`training_step` reads like the algorithm: a rollout batch arrives (the DataModule asked the worker
for it), the training forward runs with the method's quantization hook (none, own-scale fake-quant,
or guided by the rollout's record), token logprobs at the sampling temperature, group advantages,
the clipped policy loss with optional importance correction; Lightning steps the optimizer and the
WeightSync callback streams the new weights to the worker.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from trace_lightning.envs import Problem, score_responses
from trace_lightning.exact import ExactForward
from trace_lightning.guidance import FakeQuantHook, FiniteCheckHook, GuidedHook, ModelIdentity, NonFiniteActivationError
from trace_lightning.lit.batch import DemoBatch, TrainBatch, micro_batches
from trace_lightning.lit.checkpoints import check_fits, policy_weights, read_checkpoint
from trace_lightning.lit.config import RLConfig, RolloutConfig, TraceConfig, check_run_args
from trace_lightning.lit.parallel import DataParallel, full_weight_buckets, loss_scale, micro_batch_share
from trace_lightning.lit.prefetch import RecordPrefetch
from trace_lightning.lit.tensorboard import log_measured
from trace_lightning.lit.worker import RolloutWorker
from trace_lightning.methods import MethodSpec, get_method
from trace_lightning.model import CharTokenizer, MoEConfig, QuantHook, Transformer, load_hf, load_tokenizer
from trace_lightning.model.cast import weights_cast_as_they_run
from trace_lightning.quant import FakeQuantCache, parse_format
from trace_lightning.rl import (
    ADVANTAGES,
    CORRECTIONS,
    CorrectionConfig,
    PolicyLossConfig,
    policy_loss,
    token_logprobs,
)
from trace_lightning.timing import device_time, peak_memory_gib

TRAIN_COMPUTE: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""`train_compute` settings and the autocast dtype of each (None: no autocast)."""


def _as_config(cls: type, value: Any) -> Any:
    """A config dataclass from None (defaults), a dict (a loaded checkpoint's hparams) or an instance."""
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


def merged_hook(hooks: list[QuantHook | None]) -> QuantHook | None:
    """The first micro-batch's hook holding every micro-batch's audit counts: what the callbacks read of a step."""
    first = hooks[0]
    for other in hooks[1:]:
        if other is not None and hasattr(first, "absorb"):
            first.absorb(other)
    return first


class NonFiniteError(RuntimeError):
    """The training forward produced a non-finite activation, logit or loss."""


def build_policy(model: str, checkpoint: str | None, chat_template: bool | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> tuple[Transformer, Any]:
    """A preset from scratch with the built-in char tokenizer, or a local HF checkpoint and its tokenizer."""
    if checkpoint:
        return load_hf(checkpoint), load_tokenizer(checkpoint, chat_template, chat_template_kwargs)
    if chat_template or chat_template_kwargs:
        raise ValueError("model.chat_template(_kwargs) set, but only a checkpoint's tokenizer has a chat template "
                         "(the built-in char tokenizer of the presets has none)")
    config = MoEConfig.from_name(model)
    tokenizer = CharTokenizer()
    if config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model {model!r} has vocab {config.vocab_size} < char tokenizer's {tokenizer.vocab_size}")
    return Transformer(config), tokenizer


def load_policy_weights(policy: Transformer, path: str, flag: str = "--model.init_from") -> None:
    """Load the `policy.*` weights of a trace-rl Lightning checkpoint, all or nothing (CheckpointFileError naming
    `flag` and the file for a missing, unreadable or foreign one, or one of another model)."""
    weights = policy_weights(read_checkpoint(path, flag))
    check_fits(weights, {k: v.shape for k, v in policy.state_dict().items()}, f"{flag} {path}",
               policy.config.name)
    policy.load_state_dict(weights)


class PolicyModule(L.LightningModule):
    """GRPO-style RL of an MoE policy whose rollouts run in FP4."""

    def __init__(
        self,
        model: str = "debug-moe",
        checkpoint: str | None = None,
        chat_template: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        # Dataclass defaults (not None) so that `trace-rl fit --help` lists each field with its docstring.
        trace: TraceConfig = TraceConfig(),  # noqa: B008 (never mutated)
        rollout: RolloutConfig = RolloutConfig(),  # noqa: B008
        rl: RLConfig = RLConfig(),  # noqa: B008
        lr: float = 1e-3,
        warmup_lr: float = 3e-3,
        warmup_steps: int = 200,
        seed: int = 0,
        cpu_threads: int = 0,
        init_from: str | None = None,
        micro_batch_size: int | None = None,
        train_compute: str = "fp32",
    ) -> None:
        """
        Args:
            model: Model preset (trace_lightning.model presets) used when no checkpoint is given.
            checkpoint: Local Hugging Face checkpoint folder (config.json + safetensors + tokenizer.json).
            chat_template: Prompts as the checkpoint's chat template renders a user turn and the assistant's
                generation prompt (as instruct models read requests). None: where its tokenizer has a template; false:
                bos + the task's text; true: the template is required.
            chat_template_kwargs: Variables the chat template reads, e.g. {enable_thinking: false} for Qwen3.
            trace: Quantization and guidance settings.
            rollout: What each RL step samples.
            rl: The policy-gradient objective.
            lr: Learning rate of the RL phase.
            warmup_lr: Learning rate of the supervised warm-start phase.
            warmup_steps: Supervised warm-start steps before RL (0 skips the phase).
            seed: Seed of the initial weights and of every rollout.
            cpu_threads: torch intra-op threads while a Trainer runs (0 keeps torch's default; restored after).
                Tiny simulator models run fastest on 1: their ops are too small to split, and spinning threads
                collapse under CPU contention.
            init_from: Start from the policy weights of a trace-rl checkpoint (e.g. a shared warm start) with
                this run's own settings; step and optimizer start fresh. (`--ckpt_path` instead resumes a run,
                and LightningCLI then takes the run's settings from the checkpoint.)
            micro_batch_size: Sequences per forward and backward pass; a step's gradients accumulate over its
                micro-batches before the one optimizer step (the same update up to float summation order), so long
                responses train within memory. None: the whole batch in one pass.
            train_compute: The training forward's compute: fp32, or bf16 (torch.autocast over the policy's forward:
                bf16 tensor-core GEMMs on a GPU, as the rollout's `trace.rollout_compute: bf16` computes; master
                weights, gradients and the optimizer stay fp32). trace_exact trains in the rollout's compute dtype
                itself and takes fp32 here.
        """
        super().__init__()
        self.trace = _as_config(TraceConfig, trace)
        self.rollout_cfg = _as_config(RolloutConfig, rollout)
        self.rl = _as_config(RLConfig, rl)
        # Plain dicts in the checkpoint, so it loads with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["trace", "rollout", "rl"])
        self.hparams.update(trace=asdict(self.trace), rollout=asdict(self.rollout_cfg), rl=asdict(self.rl))
        self.method: MethodSpec = get_method(self.trace.method)
        self.fmt = parse_format(self.trace.fmt)
        self.correction = self.rl.correction or self.method.correction
        check_run_args(self.rl, self.rollout_cfg, lr=lr, warmup_lr=warmup_lr, warmup_steps=warmup_steps,
                       micro_batch_size=micro_batch_size, cpu_threads=cpu_threads)
        if train_compute not in TRAIN_COMPUTE:
            raise ValueError(f"unknown train_compute {train_compute!r}; expected one of {sorted(TRAIN_COMPUTE)}")
        self.train_dtype = TRAIN_COMPUTE[train_compute]
        if self.method.exact and self.train_dtype is not None:
            raise ValueError(f"train_compute {train_compute!r} with trace_exact: its training forward computes in the "
                             f"rollout's dtype (set trace.rollout_compute), leave train_compute at fp32")
        # Manual optimization: a step is zero_grad, a backward per micro-batch, one optimizer step (training_step).
        self.automatic_optimization = False
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown rl.correction {self.correction!r}; expected one of {sorted(CORRECTIONS)}")
        self.loss_config = PolicyLossConfig(
            name=self.rl.loss,
            clip_low=self.rl.clip_eps,
            clip_high=self.rl.clip_eps,
            agg_mode=self.rl.loss_agg,
            kl_coef=self.rl.kl_coef,
            correction=CorrectionConfig(name=self.correction, cap=self.rl.tis_cap, bound=self.rl.icepop_bound),
        )
        torch.manual_seed(seed)
        self.policy, self.tokenizer = build_policy(model, checkpoint, chat_template, chat_template_kwargs)
        if init_from:
            load_policy_weights(self.policy, init_from)
        self.policy_version = 0
        self.synced_identity: ModelIdentity | None = None
        """The weights the rollout engine last received (set by WeightSync; records must come from them)."""
        self.warmup_steps, self.seed = warmup_steps, seed
        # The worker holds its own (FP4) copy of the weights; keep it out of this module's parameters.
        object.__setattr__(
            self, "worker", RolloutWorker(self.policy, self.tokenizer, self.method, self.trace, self.rollout_cfg)
        )
        self._eval_workers: dict[str, RolloutWorker] = {}
        self._step_weights = FakeQuantCache()
        """The fake-quantized weights of the step in progress, shared by its micro-batches (cleared after it)."""
        self._finite_checks: list[tuple[Tensor, list[tuple[int, str] | str]]] = []
        """The step's finite checks still on the device (whether each value was finite; what each was: a forward's
        (layer, site), or a value's name), put in words only for a failure: read once,
        after its last micro-batch, where each micro-batch's three host syncs kept the host from enqueueing its
        backward before the device had caught up with its forward."""
        self.pending_checks: list[Callable[[], None]] = []
        """Checks of the step's batch running beside it (CacheExchange's record scan), each raising if the batch is
        refused: settled before the optimizer step, and before an error of the step propagates."""
        self.batch_s = 0.0
        """Wall seconds the data module took to make this step's batch (problems, rollout, scoring, alignment)."""
        self._last_step_start: float | None = None

    def setup(self, stage: str) -> None:
        """Take cpu_threads for this run only; teardown gives the process its thread count back."""
        self._threads_before = torch.get_num_threads()
        if self.hparams.cpu_threads:
            torch.set_num_threads(self.hparams.cpu_threads)

    def teardown(self, stage: str) -> None:
        torch.set_num_threads(getattr(self, "_threads_before", torch.get_num_threads()))

    # ---- training -------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.hparams.lr, betas=(0.9, 0.99), weight_decay=0.0)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move the batch's own tensors; records move lazily in the hook (they hold frozen formats)."""
        if not isinstance(batch, DemoBatch | TrainBatch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        for name, value in vars(batch).items():
            if isinstance(value, Tensor):
                setattr(batch, name, value.to(device))
            elif name == "routes" and value is not None:
                batch.routes = [r.to(device) for r in value]
        return batch

    def on_train_start(self) -> None:
        self._last_step_start = None  # time/step_s spans steps of this fit only

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = device_time(self.device)
        if self._last_step_start is not None:  # the whole previous step, wall clock: everything the others leave out
            log_measured(self, {"time/step_s": self._step_start - self._last_step_start}, self.global_step - 1)
        self._last_step_start = self._step_start

    def _log_train_time(self, step: int) -> None:
        """The step's training time (forward, backward, optimizer step; not rollout or sync) and peak memory."""
        train_s = device_time(self.device) - self._step_start
        metrics = {"time/train_s": train_s, "train/tokens_per_s": self._step_tokens / max(train_s, 1e-9),
                   "time/batch_s": self.batch_s}
        peak = peak_memory_gib(self.device)  # since the last step's: this step's rollout, sync and training
        if peak is not None:
            metrics["memory/peak_gib"] = peak
        log_measured(self, metrics, step)

    def in_warmup(self, step: int | None = None) -> bool:
        return (self.global_step if step is None else step) < self.warmup_steps

    def _set_lr(self) -> None:
        lr = self.hparams.warmup_lr if self.in_warmup() else self.hparams.lr
        for group in self.optimizers().optimizer.param_groups if self._trainer else []:
            group["lr"] = lr

    def training_step(self, batch: DemoBatch | TrainBatch, batch_idx: int) -> dict[str, Any]:
        """One optimizer step: the gradients of every micro-batch of the batch, then the update."""
        self._set_lr()
        self._finite_checks = []  # left by a forward outside a step (nothing of this step's)
        self._step_tokens = int(batch.attention_mask.sum())
        optimizer, step = self.optimizers(), self.global_step
        optimizer.zero_grad()
        try:
            out = self.supervised_step(batch) if isinstance(batch, DemoBatch) else self.rl_step(batch)
        except Exception:
            self.settle_pending_checks()  # a refused batch explains a failed step better than what it broke
            raise
        finally:
            self._step_weights.clear()  # frees them before the next rollout
        self.settle_pending_checks()
        optimizer.step()  # counts the step: global_step is step + 1 from here
        self._log_train_time(step)
        return out

    def settle_pending_checks(self) -> None:
        """Wait for every check of the step's batch still running; the first refusal raises."""
        checks, self.pending_checks = self.pending_checks, []
        for settle in checks:
            settle()

    def train_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The training forward's compute (train_compute): bf16 autocast, or nothing for fp32."""
        if self.train_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.train_dtype)

    def micro_batches(self, rows: int) -> list[slice]:
        return micro_batches(rows, self.hparams.micro_batch_size)

    def accumulate_backward(self, loss: Tensor, last: bool) -> None:
        """Backward of one micro-batch's loss; under DDP only the last one all-reduces the accumulated gradients."""
        sync = getattr(self.trainer.strategy, "block_backward_sync", None) if not last else None
        with sync() if sync is not None else contextlib.nullcontext():
            self.manual_backward(loss)

    def supervised_step(self, batch: DemoBatch) -> dict[str, Any]:
        total = torch.zeros((), device=batch.tokens.device)
        parts = self.micro_batches(batch.tokens.shape[0])
        for i, rows in enumerate(parts):
            tokens, mask, targets_mask = batch.tokens[rows], batch.attention_mask[rows], batch.target_mask[rows]
            with self.train_autocast():
                logits = self.policy(tokens[:, :-1], attention_mask=mask[:, :-1])
            targets = tokens[:, 1:].masked_fill(~targets_mask, -100)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            self._check_finite(loss, "supervised loss")
            if len(parts) > 1:
                loss = loss * micro_batch_share(targets_mask, batch.target_mask, "token_mean")
            loss = loss * self.loss_scale(batch.target_mask, "token_mean")
            self.accumulate_backward(loss, last=i == len(parts) - 1)
            total += loss.detach()
        self.raise_if_nonfinite()
        log_measured(self, {"train/sft_loss": total}, self.global_step, batch.tokens.shape[0])
        return {"loss": total}

    def training_hook(self, batch: TrainBatch, all_recorded: bool | None = None) -> QuantHook | None:
        valid = batch.attention_mask[:, :-1]
        audit = batch.audit_record if batch.audit_record is not None else False
        # FSDP gathers each weight anew per forward, so there a micro-batch quantizes its own.
        weights = None if isinstance(self.policy.tok_embeddings.weight, DTensor) else self._step_weights
        if self.method.train_quant == "guided" and batch.record is not None:
            return GuidedHook(self.fmt, batch.record, self.method.guidance_mode, valid, audit=audit, weights=weights,
                              all_recorded=all_recorded)
        if self.method.train_quant in ("qat", "guided"):
            return FakeQuantHook(self.fmt, audit=audit or None, valid_mask=valid, weights=weights)
        return None

    def training_forward(self, batch: TrainBatch, hook: QuantHook | None) -> tuple[Tensor, list[Tensor]]:
        """Token logprobs (B, T-1) of tokens[:, 1:] at the sampling temperature, and training's routes. Its finite
        checks wait on the device for ``raise_if_nonfinite``."""
        routed = batch.routes if self.trace.route_replay and batch.routes is not None else None
        if self.method.exact:
            return self.exact_forward(batch, routed)
        checked = hook if isinstance(hook, FiniteCheckHook) else FiniteCheckHook()
        checked.deferred = True  # read with the step's other checks (raise_if_nonfinite), not one sync a site
        with self.train_autocast():
            out = self.policy(batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1],
                              hook=hook or checked, routed=routed, return_routes=True)
        verdicts = checked.take_verdicts()
        if verdicts is not None:
            self._finite_checks.append(verdicts)
        logprobs = token_logprobs(out.logits.float(), batch.tokens[:, 1:], self.rollout_cfg.temperature)
        return logprobs, out.routes

    @torch.no_grad()
    def unquantized_logprobs(self, batch: TrainBatch, dtype: torch.dtype | None = None) -> Tensor:
        """Token logprobs (B, T-1) of tokens[:, 1:] from the policy's forward without quantization hooks, over
        the training step's micro-batches, with the weights as they are or cast to ``dtype`` as each module runs
        (model/cast.py): the BF16 reference's two sides, from the policy itself (no second copy of the model,
        so nothing to sync: the weights read are the ones the engine last received until the optimizer steps)."""
        cast = contextlib.nullcontext() if dtype is None else weights_cast_as_they_run(self.policy, dtype)
        parts = []
        with cast:
            for rows in self.micro_batches(batch.tokens.shape[0]):
                part = batch.rows(rows)
                routed = part.routes if self.trace.route_replay and part.routes is not None else None
                logits = self.policy(part.tokens[:, :-1], attention_mask=part.attention_mask[:, :-1], routed=routed)
                parts.append(token_logprobs(logits.float(), part.tokens[:, 1:], self.rollout_cfg.temperature))
        return torch.cat(parts)

    def exact_forward(self, batch: TrainBatch, routed: list[Tensor] | None) -> tuple[Tensor, list[Tensor]]:
        """trace_exact: the rollout engine's own invariant forward in its compute dtype, so the logprobs are the
        rollout's bit for bit (taken as the engine's sampler takes them: log_softmax of logits / temperature)."""
        engine = self.worker.engine
        out = ExactForward(self.policy, engine.compute_dtype, self.trace.fmt, kernels=engine.exact.kernels)(
            batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1], routed=routed)
        logits = out.logits.float()
        scaled = logits / self.rollout_cfg.temperature if self.rollout_cfg.temperature > 0 else logits
        logprobs = scaled.log_softmax(dim=-1).gather(-1, batch.tokens[:, 1:, None].long()).squeeze(-1)
        return logprobs, out.routes

    def rl_step(self, batch: TrainBatch) -> dict[str, Any]:
        advantages = ADVANTAGES[self.rl.advantage](batch.rewards, batch.group_size)  # whole groups, before the split
        agg, mask = self.loss_config.agg_mode, batch.response_mask
        # Each rank's share of the global loss and token-mean stats; sync_dist's rank mean is then the global value.
        rank_share, rank_token_share = self.loss_scale(mask, agg), self.loss_scale(mask, "token_mean")
        parts = self.micro_batches(batch.tokens.shape[0])
        guided = self.method.train_quant == "guided" and batch.record is not None
        records = RecordPrefetch(batch.record, parts, self.device) if guided else None
        recorded = self.recorded_rows(batch) if guided else None
        outs = []
        for i, rows in enumerate(parts):
            part = batch.rows(rows) if len(parts) > 1 or records is not None else batch
            if records is not None:
                part.record = records.get(i)  # on the device, copied while the micro-batch before it trained
            share, token_share = rank_share, rank_token_share
            if len(parts) > 1:  # this micro-batch's share of the batch's aggregate
                share = share * micro_batch_share(part.response_mask, mask, agg)
                token_share = token_share * micro_batch_share(part.response_mask, mask, "token_mean")
            all_recorded = None if recorded is None else all(recorded[rows])
            outs.append(self.rl_micro_step(part, advantages[rows], share, token_share, last=i == len(parts) - 1,
                                           all_recorded=all_recorded))
        self.raise_if_nonfinite()
        loss = torch.stack([o["loss"] for o in outs]).sum()
        stats = {key: torch.stack([o["stats"][key] for o in outs]).sum() for key in outs[0]["stats"]}
        stats |= {"policy/loss": loss}
        logprobs = torch.cat([o["logprobs"] for o in outs])
        routes = [torch.cat(layer) for layer in zip(*(o["routes"] for o in outs), strict=True)]
        hook = merged_hook([o["hook"] for o in outs])
        n = batch.tokens.shape[0]
        # Constant by construction, so not logged: one update per batch (old policy = this one) keeps clip_frac
        # and approx_kl at 0, policy/loss repeats train/loss, a correction of "none" weighs every token 1.
        skip = {"policy/loss", "policy/clip_frac", "policy/approx_kl"}
        skip |= {k for k in stats if "correction" in k} if self.correction == "none" else set()
        measured = {"train/loss": loss.detach(), "reward/mean": batch.rewards.mean(),
                    **{k: v for k, v in stats.items() if k not in skip}}
        log_measured(self, measured, self.global_step, n)
        return {"loss": loss, "logprobs": logprobs, "routes": routes, "hook": hook}

    @staticmethod
    def recorded_rows(batch: TrainBatch) -> list[bool]:
        """Per sequence, whether each of its positions is a real token with a record (GuidedHook's all_recorded):
        one host sync a step, where the hook took one a micro-batch, mid-forward."""
        assert batch.record is not None
        valid = batch.attention_mask[:, :-1].bool()
        return (batch.record.valid.to(valid.device) & valid).all(1).tolist()

    def rl_micro_step(self, part: TrainBatch, advantages: Tensor, share: Tensor, token_share: Tensor,
                      last: bool, all_recorded: bool | None = None) -> dict[str, Any]:
        """Forward and backward of one micro-batch: its loss scaled to its share of the step's, its token-mean
        stats likewise, and what the callbacks read (logprobs, routes, the hook's audit)."""
        hook = self.training_hook(part, all_recorded)
        logprobs, routes = self.training_forward(part, hook)
        mask = part.response_mask
        self._check_finite(logprobs.masked_fill(~mask, 0.0), "training logprobs")
        loss, stats = policy_loss(logprobs, None, part.rollout_logprobs, advantages, mask, self.loss_config)
        self._check_finite(loss, "policy loss")
        loss = loss * share
        self.accumulate_backward(loss, last)
        if hook is not None and hasattr(hook, "release"):
            hook.release()  # kept until the step ends for its audit counts only: not its record
        return {"loss": loss.detach(), "stats": {k: v.detach() * token_share for k, v in stats.items()},
                "logprobs": logprobs.detach(), "routes": [r.detach() for r in routes], "hook": hook}

    def _check_finite(self, value: Tensor, what: str) -> None:
        self._finite_checks.append((torch.isfinite(value).all().reshape(1), [f"non-finite {what}"]))

    def raise_if_nonfinite(self) -> None:
        """Raise NonFiniteError for the step's first non-finite activation, logit or loss, in the order the
        micro-batches computed them (one host sync a step; before the optimizer step, so nothing bad is applied)."""
        checks, self._finite_checks = self._finite_checks, []
        if not checks:
            return
        finite = torch.cat([flags for flags, _ in checks]).tolist()
        whats = [what for _, names in checks for what in names]
        for what, ok in zip(whats, finite, strict=True):
            if not ok:
                where = what if isinstance(what, str) else NonFiniteActivationError.at(*what)
                raise NonFiniteError(f"step {self.global_step}: {where}")

    def named_weights_for_sync(self) -> dict[str, Tensor]:
        """All master weights, full (gathered under FSDP)."""
        return {k: v for bucket in self.weight_buckets() for k, v in bucket.items()}

    def weight_buckets(self, bucket_bytes: int = 256 << 20) -> Iterator[dict[str, Tensor]]:
        """Full master weights bucket by bucket: under FSDP one all-gather per bucket, not the whole model."""
        return full_weight_buckets(self.policy.state_dict(), bucket_bytes)

    # ---- data parallel --------------------------------------------------------------------------
    @property
    def data_parallel(self) -> DataParallel:
        """This rank among the data-parallel replicas (rank 0 of 1 outside a distributed fit)."""
        return DataParallel.of(self._trainer.strategy) if self._trainer is not None else DataParallel()

    def reduce_over_ranks(self, value: Tensor, op: str = "sum") -> Tensor:
        """A sum or max over data-parallel ranks (the value itself on one rank)."""
        if self.data_parallel.size == 1:
            return value
        return self.trainer.strategy.reduce(value.clone(), reduce_op=op)

    def loss_scale(self, mask: Tensor, agg_mode: str) -> Tensor:
        """This rank's share of a loss aggregated over all ranks' samples (lit.parallel.loss_scale)."""
        return loss_scale(mask, agg_mode, self.data_parallel, self.reduce_over_ranks)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy, shard the trainer's policy with FSDP2 (each block, then the root) over
        the data-parallel mesh; the rollout engines keep full weights (WeightSync gathers them per bucket)."""
        mesh = self.device_mesh
        if mesh is None or any(isinstance(p, DTensor) for p in self.policy.parameters()):
            return
        from torch.distributed.fsdp import fully_shard

        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"tensor parallelism is not supported; set the strategy's tensor_parallel_size=1 "
                             f"(got {mesh['tensor_parallel'].size()})")
        for block in self.policy.layers:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.policy, mesh=mesh["data_parallel"])

    # ---- evaluation -----------------------------------------------------------------------------
    def _eval_worker(self, method: str) -> RolloutWorker:
        """The FP4 and BF16 engines used for evaluation (the training worker when it matches)."""
        spec = get_method(method)
        if spec.rollout_fp4 == self.method.rollout_fp4:
            return self.worker
        if method not in self._eval_workers:
            trace = TraceConfig(**{**vars(self.trace), "method": method})
            self._eval_workers[method] = RolloutWorker(self.policy, self.tokenizer, spec, trace, self.rollout_cfg)
        worker = self._eval_workers[method]
        worker.sync(self.named_weights_for_sync(), self.policy_version)
        return worker

    def _worker_up_to_date(self) -> None:
        """A standalone validate/predict loads weights after the worker was built: sync it once."""
        if self.worker.policy_version != self.policy_version or self.trainer.state.fn != "fit":
            self.worker.sync(self.named_weights_for_sync(), self.policy_version)

    def on_validation_epoch_start(self) -> None:
        self._worker_up_to_date()
        self._eval = {"eval/accuracy": self._eval_worker("fp4_naive"), "eval/bf16_accuracy": self._eval_worker("bf16")}
        self._eval_hits: dict[str, list[float]] = {key: [] for key in self._eval}

    def validation_step(self, batch: list[Problem], batch_idx: int) -> None:
        env = self.trainer.datamodule.eval_env  # the held-out problems' env scores them
        for key, worker in self._eval.items():
            rows = worker.predict_step(batch, batch_idx, env=env)
            # the batch's answers score at once, in parallel and each within the env's limit (envs/scoring.py)
            self._eval_hits[key].extend(score_responses(env, batch, [row["response"] for row in rows]).rewards)

    def on_validation_epoch_end(self) -> None:
        accuracy = {key: self._gathered_accuracy(hits) for key, hits in self._eval_hits.items()}
        for key, value in accuracy.items():
            if value is not None:  # already over all ranks; sync_dist's mean of equal values keeps it
                self.log(key, value, prog_bar=key == "eval/accuracy", sync_dist=True)
        if self.method.name == "bf16" and accuracy["eval/accuracy"] is not None:
            # The bf16 method's policy, quantized post hoc by the FP4 engine, is the PTQ baseline.
            self.log("eval/ptq_accuracy", accuracy["eval/accuracy"], sync_dist=True)

    def _gathered_accuracy(self, hits: list[float]) -> float | None:
        """Hits over every rank's share of the evaluation problems (None when nothing was evaluated)."""
        totals = self.reduce_over_ranks(torch.tensor([sum(hits), len(hits)], dtype=torch.float64, device=self.device))
        return float(totals[0] / totals[1]) if totals[1] > 0 else None

    def on_predict_start(self) -> None:
        self._worker_up_to_date()

    def predict_step(self, batch: list[Problem], batch_idx: int) -> list[dict[str, Any]]:
        rows = self.worker.predict_step(batch, batch_idx)
        for row in rows:  # `trace-rl predict` prints one JSON line per sample
            print(json.dumps(row))
        return rows

    # ---- checkpoint state -----------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["policy_version"] = self.policy_version
        checkpoint["rng_state"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_version = int(checkpoint.get("policy_version", 0))
        if "rng_state" in checkpoint:
            torch.set_rng_state(checkpoint["rng_state"])
