"""The rollout worker: a LightningModule around the embedded FP4 engine.

It owns the engine's copy of the policy (FP4 weights, FP4 activations, FP4 KV cache, or BF16 for
the reference method), turns problems into scored, aligned TrainBatches with their records, and
samples for `trace-rl predict`. Its weights only change through `sync`, which re-quantizes with the
same quantizer the trainer's QAT uses and keeps the FP4 byte checksums for the audit.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from trace_lightning.envs import Env, MultiTurnEnv, Problem, score_responses
from trace_lightning.lit.batch import TrainBatch, pad_sequences, place, response_targets
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.episodes import multiturn_predict, multiturn_rollout
from trace_lightning.lit.record_placement import cuda_memory, record_goes_to_host
from trace_lightning.methods import MethodSpec
from trace_lightning.model import Transformer
from trace_lightning.quant import parse_format
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rollout_precision(method: MethodSpec, trace: TraceConfig) -> Any:
    if trace.rollout_compute not in _DTYPES:
        raise ValueError(f"trace.rollout_compute must be one of {sorted(_DTYPES)}, got {trace.rollout_compute!r}")
    if not method.rollout_fp4:
        return trace.rollout_compute
    fmt = parse_format(trace.fmt)
    return FP4Precision(fmt=fmt.kind, mx_mode=fmt.mx_mode, compute_dtype=_DTYPES[trace.rollout_compute])


def engine_copy(policy: Transformer) -> Transformer:
    """The engine's own copy of the policy. A sharded (FSDP) policy cannot be copied: an unsharded model of the same
    config stands in (the global RNG left as it was), and the first weight sync sets all of its weights."""
    if not any(isinstance(p, DTensor) for p in policy.parameters()):
        return copy.deepcopy(policy)
    with torch.random.fork_rng(devices=[]):
        return Transformer(policy.config).to(next(policy.parameters()).device)


class RolloutWorker(L.LightningModule):
    """Generates rollouts with the FP4 engine; `predict_step` samples from the current policy."""

    def __init__(
        self, policy: Transformer, tokenizer: Any, method: MethodSpec, trace: TraceConfig, rollout: RolloutConfig
    ) -> None:
        super().__init__()
        self.tokenizer, self.method, self.trace, self.rollout_cfg = tokenizer, method, trace, rollout
        object.__setattr__(self, "_policy", policy)  # the trainer's module: followed, not owned (no child module)
        rollout_precision(method, trace)  # a bad setting fails here, not at the first rollout
        self._engine: Engine | None = None
        self.record_layers: list[int] = []
        """Layers whose record is kept (set by the DepthSelectiveCompaction callback)."""
        self.audit_next = False
        """Capture full records of every layer on the next rollout (set by the compaction callback)."""
        self._record_placement: dict[tuple[int, int, Any], bool] = {}
        """trace.records_on_host "auto": host (True) or device, per (rows, positions, record layout)."""

    @property
    def engine(self) -> Engine:
        """The engine on the policy's current device. Built from a copy of the policy on first use, and built again
        when the policy has moved since (Lightning moves the trainer's module after constructing it), so the
        rollout runs where training runs (the Triton backend and CUDA graphs on a GPU), not on the CPU copy the
        module started as; the policy version carries over."""
        device = next(self._policy.parameters()).device
        if self._engine is None or self._engine.device != device:
            version = 0 if self._engine is None else self._engine.policy_version
            self._engine = None  # free the old copy before making the new one
            precision = rollout_precision(self.method, self.trace)
            self._engine = Engine(engine_copy(self._policy).eval(), precision, backend=self.trace.backend,
                                  cuda_graph=self.trace.cuda_graph, prefill_chunk=self.rollout_cfg.prefill_chunk,
                                  keep_decode_graph=self.trace.keep_decode_graph, exact=self.method.exact)
            self._engine.policy_version = version
        return self._engine

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def sync(self, named_tensors: Mapping[str, Tensor], version: int) -> dict[str, str]:
        """Load the weights into the engine; -> their digests (Engine.update_weights)."""
        return self.engine.update_weights(named_tensors, version)

    def weight_checksums(self) -> dict[str, str]:
        return self.engine.weight_checksums()

    def capture_spec(self, prompts: list[list[int]] | None = None) -> CaptureSpec | None:
        """What the next rollout records: the recorded layers' sites (every layer's full codes on an audit); with
        the rollout's `prompts`, where its record lives (trace.records_on_host, lit/record_placement.py; without
        them, "auto" keeps it on the device: a multi-turn episode's live batch needs it there)."""
        if not self.method.rollout_fp4 or self.method.exact:  # trace_exact: training recomputes, nothing to record
            return None
        config = self.engine.config
        every = range(config.n_layers) if self.audit_next else self.record_layers
        layers = {layer for layer in every if config.is_quantized_layer(layer)}
        if not layers:
            return None
        # an audit needs the codes of every layer and site; otherwise record only what guidance reads (parity: 4x
        # smaller, and only trace.sites)
        if self.audit_next:
            spec = CaptureSpec(layers=layers, mode="full")
        else:
            spec = CaptureSpec(layers=layers, sites=self.trace.sites or "all", mode=self.method.guidance_mode or "full")
        return dataclasses.replace(spec, stream_to_host=self._records_on_host(spec, prompts))

    def _records_on_host(self, spec: CaptureSpec, prompts: list[list[int]] | None) -> bool:
        setting = self.trace.records_on_host
        if setting != "auto" or prompts is None:
            return setting is True
        max_len = max(len(p) for p in prompts) + self.rollout_cfg.max_new_tokens
        shape = (len(prompts), max_len, self.engine.record_layout(spec))
        if shape not in self._record_placement:  # once per shape: a flip would rebuild the kept decode session
            record = self.engine.memory_plan(len(prompts), max_len, spec).records
            self._record_placement[shape] = record_goes_to_host(setting, self.engine.device, record,
                                                                cuda_memory(self.engine.device))
        return self._record_placement[shape]

    def generate(
        self,
        prompts: list[list[int]],
        seed: int | Sequence[int],
        greedy: bool = False,
        capture: CaptureSpec | None = None,
        one_off: bool = False,
    ) -> RolloutBatch:
        return self.engine.generate(prompts, self.sampling_params(seed, greedy), capture=capture,
                                    max_batch=self.rollout_cfg.max_batch, one_off=one_off)

    def sampling_params(self, seed: int | Sequence[int], greedy: bool = False) -> SamplingParams:
        """How rollouts (greedy: evaluation and predict) sample: the rollout settings, ending at the tokenizer's stop
        ids (eos, and a checkpoint's other end-of-generation ids), not before min_new_tokens in RL rollouts."""
        r = self.rollout_cfg
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                              top_k=r.top_k, top_p=r.top_p, seed=seed, stop_token_ids=self.tokenizer.stop_ids,
                              min_new_tokens=0 if greedy else r.min_new_tokens)

    def encode_prompt(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode_prompt(problem.prompt)

    def group_prompts(self, problems: list[Problem]) -> list[list[int]]:
        """Each problem's prompt ids group_size times, a rollout each (encoded once a problem: a chat template's
        rendering is not free)."""
        g = self.rollout_cfg.group_size
        return [ids for ids in map(self.encode_prompt, problems) for _ in range(g)]

    def decode_response(self, response: list[int]) -> str:
        """Text of a response, decoded in runs: token by token would drop a sentencepiece tokenizer's word spaces
        and split UTF-8 characters that span tokens. Stop ids read as nothing, ids past the tokenizer's vocabulary
        (the model's is larger) as '?'."""
        tok, stops = self.tokenizer, set(self.tokenizer.stop_ids)
        kept = [t for t in response if t not in stops]
        if not kept or max(kept) < tok.vocab_size:
            return tok.decode(kept)
        parts = []
        for outside, run in itertools.groupby(kept, key=lambda t: t >= tok.vocab_size):
            ids = list(run)
            parts.append("?" * len(ids) if outside else tok.decode(ids))
        return "".join(parts)

    def rollout(self, env: Env, problems: list[Problem], seed: int | Sequence[int]) -> TrainBatch:
        """Sample group_size responses per problem, score them and align everything for training.

        seed: one batch seed, or one seed per sequence (a data-parallel rank's share of the global batch's).
        A multi-turn env's episodes interleave its replies (lit/episodes.py)."""
        if isinstance(env, MultiTurnEnv):
            return multiturn_rollout(self, env, problems, seed)
        g = self.rollout_cfg.group_size
        prompts = self.group_prompts(problems)
        capture = self.capture_spec(prompts)
        start = time.perf_counter()
        # an audit's capture (every layer's codes) is a shape of its own: the engine's kept decode session, the next
        # rollout's, stays
        out = self.generate(prompts, seed, capture=capture, one_off=self.audit_next)
        elapsed = time.perf_counter() - start
        texts = [self.decode_response(r) for r in out.responses]
        # a verifier that stalls or crashes scores its answer 0 within its limit (envs/scoring.py), and the fit goes on
        scored = score_responses(env, [problems[i // g] for i in range(len(texts))], texts)
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)
        batch = self._align(prompts, out, rewards, g)
        n_new = sum(len(r) for r in out.responses)
        batch.rollout_stats = {"rollout/tokens_per_s": n_new / max(elapsed, 1e-9), "time/rollout_s": elapsed,
                               "rollout/decode_steps": out.stats["decode_steps"],
                               "rollout/prefill_s": out.stats["prefill_s"],
                               "rollout/graph_capture_s": out.stats["capture_s"], **scored.stats()}
        if capture is not None:
            batch.rollout_stats["rollout/records_on_host"] = float(capture.stream_to_host)
        if self.rollout_cfg.max_batch is not None:
            batch.rollout_stats["rollout/refills"] = out.stats["refills"]
        batch.samples = [
            {"prompt": problems[i // g].prompt, "response": texts[i], "reward": float(rewards[i])}
            for i in range(0, len(texts), max(1, len(texts) // 4))
        ]
        if out.record is not None:
            self._attach_records(batch, out)
        self.audit_next = False
        return batch

    def _align(self, prompts: list[list[int]], out: RolloutBatch, rewards: Tensor, group_size: int) -> TrainBatch:
        seqs = [p + r for p, r in zip(prompts, out.responses, strict=True)]
        tokens, attention_mask = pad_sequences(seqs, self.tokenizer.pad_id)
        width = tokens.shape[1]
        response_mask = response_targets([len(p) for p in prompts], [len(s) for s in seqs], width)
        logprobs = place(out.logprobs, [len(p) - 1 for p in prompts], width - 1, 0.0, torch.float32)
        # per layer (B, width - 1, top_k), padded with expert 0 as it always was: another padding changes how many
        # rows each expert's GEMM sees, and so (BLAS blocking) real tokens' values by ulps, and the run with them
        table = out.route_table[:, :, : width - 1].long()
        lengths = torch.tensor([out.record_length(i) for i in range(len(out))], device=table.device)
        real = torch.arange(width - 1, device=table.device) < lengths[:, None]
        routes = list(torch.where(real[None, :, :, None], table, 0).unbind(0))
        return TrainBatch(
            tokens=tokens,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            rewards=rewards,
            group_size=group_size,
            policy_version=out.policy_version,
            routes=routes,
        )

    def _attach_records(self, batch: TrainBatch, out: RolloutBatch) -> None:
        """The batch record, cut to the training window, on the engine's device: guidance reads its compaction
        (mode, layers; a no-op unless this is an audit step, which recorded full codes of every layer)."""
        assert out.record is not None
        start = time.perf_counter()
        record = out.record.window(batch.tokens.shape[1] - 1)
        if self.method.records:
            batch.record = record.compact(self.method.guidance_mode or "full", layers=self.record_layers,
                                          sites=self.trace.sites)
        if self.audit_next:
            batch.audit_record = record
        elapsed = time.perf_counter() - start
        batch.rollout_stats["guidance/capture_ms"], batch.rollout_stats["time/records_s"] = 1000 * elapsed, elapsed

    def predict_step(self, batch: list[Problem], batch_idx: int, env: Env | None = None) -> list[dict[str, Any]]:
        """Greedy responses; with a multi-turn env, greedy episodes (the response is the transcript)."""
        if isinstance(env, MultiTurnEnv):
            return multiturn_predict(self, env, batch, batch_idx)
        prompts = [self.encode_prompt(p) for p in batch]
        out = self.generate(prompts, seed=batch_idx, greedy=True)
        return [
            {"prompt": p.prompt, "response": self.decode_response(r), "answer": p.answer}
            for p, r in zip(batch, out.responses, strict=True)
        ]
