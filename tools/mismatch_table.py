"""Rollout-training mismatch of every method and record layer policy, measured on the same FP4 rollouts.

How much of the rollout's rounding the training forward must replay, and in which layers, is an empirical
question: the default layer policy of ``trace_compact`` (DESIGN.md section 6) is read off the depth frontier
this tool measures. It builds a policy (random init, a quick supervised warm start on the arithmetic env, or a
checkpoint), samples rollouts with the FP4 engine computing in bf16 (a deployment whose kernels round
differently from the trainer) and full records of every quantized layer, then runs the fp32 training forward
of each method over exactly those tokens and prints one row per method:

- the section-7 mismatch metrics over response tokens (``rl.mismatch_metrics``);
- ``code_agreement``: the codes the training forward rounded to vs the rollout's (guided sites use the
  record's; unguided ones training's own RNE codes), over every quantized site and real position;
  ``own_code_agreement``: training's own RNE codes vs the rollout's (DESIGN.md's ``quant/code_agreement``);
  ``value_agreement``: the values the forward used vs the rollout's dequantized ones;
- ``route_agreement``: the fraction of response positions whose top-k expert set equals the rollout's
  (mean over layers);
- ``bytes_per_token``: the record payload per token position, routes included (routes alone for route replay).

``bf16`` is the BF16 engine against its own rollouts (no record, agreements n/a); ``fp4_naive`` does not round,
its code agreement is that of the codes it would round to. ``fp4_qat_tis`` is left out: truncated importance
sampling reweights the loss, its training forward is ``fp4_qat``'s. With ``--policies`` come parity records
over the deep:F, last:K, budget:B and auto layer policies, auto ranked by an fp4_qat code-agreement audit on
a separate rollout batch and given the bytes of each deep:F, plus explicit shallow layer sets (``layers=0,1``:
not a policy kind, there to show whether the shallow layers' flips matter more than the deep ones').

Run: python tools/mismatch_table.py --preset debug-moe [--steps N] [--json out.json] [--policies]
     [--train-steps N] [--checkpoint PATH] [--seed S] [--env countdown] [--device cuda]
With --device cuda the engines run the Triton kernels (bf16 compute) and the training forward the GPU's fp32: the
frontier of a GPU-trained policy (e.g. the GPU fit's checkpoint, on its own task with --env countdown).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trace_lightning.envs import Env, Problem, make_env
from trace_lightning.guidance import (
    BatchRecord,
    FakeQuantHook,
    GuidedHook,
    QuantRecord,
    collate_records,
    layer_bytes_per_token,
    select_layers,
)
from trace_lightning.lit.batch import pad_sequences, response_targets
from trace_lightning.lit.callbacks import route_agreement
from trace_lightning.lit.policy import build_policy
from trace_lightning.methods import METHODS
from trace_lightning.model import MoEConfig, QuantHook, Transformer
from trace_lightning.quant import FP4Format, guided_quantize, parse_format
from trace_lightning.rl import MismatchMetric, token_logprobs
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, RolloutBatch, SamplingParams

BASE_METHODS = ("bf16", "fp4_naive", "fp4_qat", "trace", "trace_compact")
REPLAYED = ("fp4_naive", "fp4_qat", "trace", "trace_compact")
DEEP_FRACTIONS = (0.25, 0.5, 0.75)
AUDIT_STEP = 10**6
"""Seed offset of the rollout batch the auto policy is ranked on (never one of the measured batches)."""
COLUMNS = ("method", "layers", "k3_kl", "logprob_abs_diff", "prob_abs_diff", "token_mult_prob_error",
           "code_agreement", "own_code_agreement", "value_agreement", "route_agreement", "bytes_per_token")


# ---- the policy ------------------------------------------------------------------------------------------
def load_policy(preset: str, checkpoint: str | None) -> tuple[Transformer, Any]:
    """A preset (random init), a Hugging Face folder, or a Lightning .ckpt of PolicyModule ("policy." keys)."""
    if checkpoint is None or Path(checkpoint).is_dir():
        return build_policy(preset, checkpoint)
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model, tokenizer = build_policy(ckpt.get("hyper_parameters", {}).get("model", preset), None)
    state = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    model.load_state_dict(state)
    return model, tokenizer


def demonstrations(tokenizer: Any, env: Env, problems: list[Problem]) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt + target + EOS, right-padded: tokens (B, T), attention mask (B, T), target mask (B, T-1)."""
    prompts = [tokenizer.encode_prompt(p.prompt) for p in problems]
    seqs = [p + tokenizer.encode(env.demonstration(q)) + [tokenizer.eos_id] for p, q in zip(prompts, problems,
                                                                                             strict=True)]
    tokens, mask = pad_sequences(seqs, tokenizer.pad_id)
    return tokens, mask, response_targets([len(p) for p in prompts], [len(s) for s in seqs], tokens.shape[1])


def warm_start(model: Transformer, tokenizer: Any, env: Env, steps: int, seed: int, batch_size: int = 64,
               lr: float = 3e-3) -> float:
    """The supervised warm start of PolicyModule (fp32, unquantized) for `steps` steps; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    device = next(model.parameters()).device
    for step in range(steps):
        tokens, mask, targets = (t.to(device) for t in demonstrations(
            tokenizer, env, env.sample(batch_size, seed=seed * 1_000_003 + step)))
        logits = model(tokens[:, :-1], attention_mask=mask[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].masked_fill(~targets, -100).flatten(),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    return float(loss.detach())


def make_prompts(tokenizer: Any, env: Env, n: int, seed: int, random_share: float
                 ) -> tuple[list[list[int]], list[Problem | None]]:
    """n prompts: arithmetic problems from a seed range training never draws from, then random-token ones."""
    n_random = round(n * random_share)
    problems: list[Problem | None] = list(env.sample(n - n_random, seed=10**9 + seed))
    prompts = [tokenizer.encode_prompt(p.prompt) for p in problems if p is not None]
    rng = random.Random(seed)
    prompts += [[tokenizer.bos_id, *(rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(4, 12)))]
                for _ in range(n_random)]
    return prompts, problems + [None] * n_random


# ---- rollouts, aligned like RolloutWorker._align ----------------------------------------------------------
@dataclass
class Rollouts:
    """One rollout batch aligned for the training forward over tokens[:, :-1]."""

    tokens: Tensor
    """(B, T) prompt + response, right-padded."""
    attention_mask: Tensor
    """(B, T) True on real tokens."""
    response_mask: Tensor
    """(B, T-1) True where tokens[:, 1:] is a sampled response token."""
    logprobs: Tensor
    """(B, T-1) rollout logprob of tokens[:, 1:] (0 outside the response)."""
    routes: list[Tensor]
    """Per layer (B, T-1, top_k) rollout expert ids."""
    records: list[QuantRecord]
    """Per sequence full records of every quantized layer (empty for the BF16 engine)."""
    rewards: list[float] = field(default_factory=list)
    """Verifier rewards of the arithmetic prompts' responses."""

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1]) - 1

    def batch_record(self, mode: str = "full", layers: Sequence[int] | None = None) -> BatchRecord:
        return collate_records([r.compact(mode, layers) for r in self.records], pad_to=self.width)


def pad_routes(routes: list[Tensor], width: int) -> list[Tensor]:
    """Per-sequence [L, T_b - 1, k] -> per layer (B, width, k), padded with expert ids 0..k-1."""
    n_layers, top_k = routes[0].shape[0], routes[0].shape[-1]
    out = torch.arange(top_k).expand(n_layers, len(routes), width, top_k).clone()  # on the host
    for b, r in enumerate(routes):
        out[:, b, : r.shape[1]] = r[:, :width].long().cpu()
    return list(out.unbind(0))


def align(out: RolloutBatch, tokenizer: Any, env: Env, problems: list[Problem | None]) -> Rollouts:
    """The batch for the training forward, on the engine's device (where its records are)."""
    seqs = [p + r for p, r in zip(out.prompts, out.responses, strict=True)]
    tokens, mask = pad_sequences(seqs, tokenizer.pad_id)
    width = tokens.shape[1] - 1
    logprobs = torch.zeros(len(seqs), width)
    for i, (p, lp) in enumerate(zip(out.prompts, out.logprobs, strict=True)):
        logprobs[i, len(p) - 1 : len(p) - 1 + len(lp)] = torch.tensor(lp)
    records = [QuantRecord.from_captures(c, r, out.policy_version) for c, r in zip(out.captures or [], out.routes,
                                                                                   strict=False)]
    rewards = [env.score(q, tokenizer.decode([t for t in r if t < tokenizer.vocab_size]))
               for q, r in zip(problems, out.responses, strict=True) if q is not None]
    device = out.route_table.device
    return Rollouts(tokens.to(device), mask.to(device),
                    response_targets([len(p) for p in out.prompts], [len(s) for s in seqs], width + 1).to(device),
                    logprobs.to(device), [r.to(device) for r in pad_routes(out.routes, width)], records, rewards)


# ---- what each row runs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """A row: which engine's rollouts, what the training forward does, which layers it is guided at."""

    name: str
    rollout_fp4: bool = True
    train_quant: str = "none"
    """"none" (fp32), "qat" (own-scale fake-quant) or "guided" (rounds to the record)."""
    mode: str | None = None
    """Guided: "full" codes or "parity" bits."""
    layers: tuple[int, ...] = ()
    """Guided: the recorded layers."""
    route_replay: bool = False
    policy: str = "-"
    """How the layers were chosen, for the table."""


def method_variants(config: MoEConfig, fmt: FP4Format) -> list[Variant]:
    """The methods of DESIGN.md section 6 (from METHODS) and their route-replay twins."""
    costs = layer_bytes_per_token(config, fmt, "parity")
    out: dict[str, Variant] = {}
    for name in BASE_METHODS:
        spec = METHODS[name]
        layers = tuple(select_layers(spec.default_layers, config.n_layers, costs)) if spec.records else ()
        out[name] = Variant(name, spec.rollout_fp4, spec.train_quant, spec.guidance_mode, layers,
                            policy=spec.default_layers if spec.records else "-")
    replayed = [replace(out[name], name=f"{name}+route_replay", route_replay=True) for name in REPLAYED]
    return [*out.values(), *replayed]


def policy_variants(config: MoEConfig, fmt: FP4Format, audit: dict[int, float]) -> list[Variant]:
    """Parity records over layer policies, auto at the bytes of each deep:F, shallow layer sets for contrast;
    each without and with route replay (the record carries the routes either way)."""
    costs = layer_bytes_per_token(config, fmt, "parity")
    per_layer = min(costs.values())
    deep = [f"deep:{f:g}" for f in DEEP_FRACTIONS]
    budgets = [f"budget:{round(per_layer * 1.5, -1):.0f}", f"budget:{round(per_layer * 2.5, -1):.0f}"]
    autos = [f"auto:{sum(costs[i] for i in select_layers(p, config.n_layers, costs)):.0f}" for p in deep]
    policies = [*deep, "last:1", *budgets, "auto", *autos]
    rows = [Variant(f"trace_compact[{p}]", True, "guided", "parity",
                    tuple(select_layers(p, config.n_layers, costs, audit)), policy=p) for p in policies]
    quantized = sorted(costs)
    for n in range(1, len(quantized)):
        layers = tuple(quantized[:n])
        rows.append(Variant(f"trace_compact[layers={','.join(map(str, layers))}]", True, "guided", "parity",
                            layers, policy="shallow"))
    replayed = [replace(v, name=v.name.replace("trace_compact", "trace_compact+route_replay"), route_replay=True)
                for v in rows]
    return rows + replayed


# ---- the audit -------------------------------------------------------------------------------------------
@dataclass
class Counts:
    elements: int = 0
    used: int = 0
    own: int = 0
    value: int = 0

    def add(self, other: Counts) -> None:
        self.elements, self.used = self.elements + other.elements, self.used + other.used
        self.own, self.value = self.own + other.own, self.value + other.value

    def fraction(self, name: str) -> float:
        return getattr(self, name) / self.elements if self.elements else float("nan")


def _same_code(a: Tensor, b: Tensor) -> Tensor:
    """Equal E2M1 codes; codes 0 and 8 (+0 and -0) count as equal."""
    return (a == b) | (((a & 7) == 0) & ((b & 7) == 0))


class AgreementAudit(QuantHook):
    """Wraps a training hook (None: the unquantized forward) and compares every site with the full record.

    Counts per (layer, site), over real positions: the codes the forward rounded to (the guide's at guided
    sites, else training's own RNE codes), training's own RNE codes, and the values it used, each against the
    rollout's.
    """

    def __init__(self, inner: QuantHook | None, fmt: FP4Format, audit: BatchRecord, valid: Tensor,
                 guide: BatchRecord | None = None) -> None:
        self.inner, self.fmt, self.audit, self.valid, self.guide = inner or QuantHook(), fmt, audit, valid, guide
        self.counts: dict[tuple[int, str], Counts] = {}

    def weight(self, w: Tensor, *, layer: int, name: str) -> Tensor:
        return self.inner.weight(w, layer=layer, name=name)

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        out = self.inner.activation(x, layer=layer, site=site)
        if self.audit.has(layer, site):
            self._count(x.detach(), out.detach(), layer, site)
        return out

    @torch.no_grad()
    def _count(self, x: Tensor, out: Tensor, layer: int, site: str) -> None:
        ref = self.audit.ref(layer, site)
        valid = self.audit.valid & self.valid
        mask = valid.reshape(*valid.shape, *([1] * (x.dim() - 2))).expand(x.shape)
        theirs, own = ref.codes(), self.fmt.quantize(x).codes()
        guided = self.guide is not None and self.guide.has(layer, site)
        used = guided_quantize(x, self.guide.ref(layer, site), self.guide.mode).codes() if guided else own
        stats = self.counts.setdefault((layer, site), Counts())
        stats.add(Counts(int(mask.sum()), int((_same_code(used, theirs) & mask).sum()),
                         int((_same_code(own, theirs) & mask).sum()), int(((out == ref.dequantize()) & mask).sum())))

    def by_layer(self) -> dict[int, Counts]:
        out: dict[int, Counts] = {}
        for (layer, _), c in sorted(self.counts.items()):
            out.setdefault(layer, Counts()).add(c)
        return out


# ---- measuring -------------------------------------------------------------------------------------------
@dataclass
class Row:
    """Accumulates one variant's measurements over rollout batches."""

    variant: Variant
    mismatch: MismatchMetric = field(default_factory=MismatchMetric)
    counts: dict[int, Counts] = field(default_factory=dict)
    route_same: float = 0.0
    route_positions: int = 0
    payload_bytes: int = 0
    positions: int = 0

    def result(self) -> dict[str, Any]:
        v = self.variant
        total = Counts()
        for c in self.counts.values():
            total.add(c)
        out: dict[str, Any] = {"method": v.name, "policy": v.policy, "layers": list(v.layers),
                               "route_replay": v.route_replay}
        out.update({k.removeprefix("mismatch/"): float(x) for k, x in self.mismatch.compute().items()})
        out.update(code_agreement=total.fraction("used"), own_code_agreement=total.fraction("own"),
                   value_agreement=total.fraction("value"),
                   route_agreement=self.route_same / max(self.route_positions, 1),
                   bytes_per_token=self.payload_bytes / max(self.positions, 1),
                   layer_code_agreement={str(k): c.fraction("used") for k, c in self.counts.items()},
                   layer_own_code_agreement={str(k): c.fraction("own") for k, c in self.counts.items()})
        return out


def training_hook(v: Variant, fmt: FP4Format, batch: Rollouts) -> tuple[QuantHook | None, BatchRecord | None]:
    valid = batch.attention_mask[:, :-1]
    if v.train_quant == "qat":
        return FakeQuantHook(fmt, valid_mask=valid), None
    if v.train_quant == "guided":
        guide = batch.batch_record(v.mode or "parity", v.layers)
        return GuidedHook(fmt, guide, v.mode, valid), guide
    return None, None


def record_bytes(v: Variant, batch: Rollouts) -> int:
    """What the rollout ships for this variant: the compacted records, the routes alone, or nothing."""
    if v.train_quant == "guided":
        return sum(r.compact(v.mode, v.layers).payload_bytes() for r in batch.records)
    return sum(r.routes.nbytes for r in batch.records) if v.route_replay else 0


@torch.no_grad()
def measure(model: Transformer, row: Row, batch: Rollouts, fmt: FP4Format, temperature: float) -> None:
    """The training forward of row's variant over batch; adds its metrics to row."""
    v, valid = row.variant, batch.attention_mask[:, :-1]
    row.mismatch.to(valid.device)
    inner, guide = training_hook(v, fmt, batch)
    hook = AgreementAudit(inner, fmt, batch.batch_record(), valid, guide) if v.rollout_fp4 else inner
    out = model(batch.tokens[:, :-1], attention_mask=valid, hook=hook, routed=batch.routes if v.route_replay else None,
                return_routes=True)
    row.mismatch.update(token_logprobs(out.logits, batch.tokens[:, 1:], temperature), batch.logprobs,
                        batch.response_mask)
    n = int(batch.response_mask.sum())
    agree = route_agreement(out.routes, batch.routes, batch.response_mask)
    row.route_same += n * sum(agree) / len(agree)
    row.route_positions += n
    if isinstance(hook, AgreementAudit):
        for layer, c in hook.by_layer().items():
            row.counts.setdefault(layer, Counts()).add(c)
    row.payload_bytes += record_bytes(v, batch)
    row.positions += sum(r.length for r in batch.records) if batch.records else int(valid.sum())


def audit_layers(model: Transformer, batch: Rollouts, fmt: FP4Format) -> dict[int, float]:
    """Code agreement per layer of plain fake-quant (fp4_qat) against full records: the auto policy's ranking."""
    hook = FakeQuantHook(fmt, audit=batch.batch_record(), valid_mask=batch.attention_mask[:, :-1])
    with torch.no_grad():
        model(batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1], hook=hook)
    return hook.layer_agreement()


# ---- the table -------------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "-"
    return str(value)


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug-moe", help="model preset (ignored with an HF checkpoint folder)")
    p.add_argument("--checkpoint", default=None, help="Lightning .ckpt of trace-rl fit, or a Hugging Face folder")
    p.add_argument("--train-steps", type=int, default=0,
                   help="supervised warm-start steps on arithmetic demonstrations before measuring (0: none)")
    p.add_argument("--steps", type=int, default=8, help="rollout batches to measure (metrics pool their tokens)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout batch")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--random-prompts", type=float, default=None,
                   help="share of random-token prompts (default: 0.5 on a random-init model, else 0)")
    p.add_argument("--fmt", default="nvfp4", help="FP4 format of rollout and training (nvfp4, mxfp4, ...)")
    p.add_argument("--policies", action="store_true", help="add parity rows over layer policies")
    p.add_argument("--json", default=None, help="write the rows as a JSON list here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny models run fastest on 1)")
    p.add_argument("--env", default="arithmetic", help="the task the prompts come from (the policy's own, trained)")
    p.add_argument("--device", default="cpu", help="cpu (the sim engines) or cuda (the Triton engines)")
    return p.parse_args(argv)


def prepare_policy(args: argparse.Namespace) -> tuple[Transformer, Any, Env, float]:
    """The policy to measure (frozen, on --device), its tokenizer, the --env task and the last warm-start loss (NaN:
    none)."""
    model, tokenizer = load_policy(args.preset, args.checkpoint)
    model = model.to(args.device)
    env = make_env(args.env)
    loss = warm_start(model, tokenizer, env, args.train_steps, args.seed) if args.train_steps else float("nan")
    model.eval().requires_grad_(False)
    return model, tokenizer, env, loss


class Sampler:
    """Both engines on the same prompts and seeds: FP4 (bf16 compute, full records of every layer) and BF16."""

    def __init__(self, model: Transformer, tokenizer: Any, env: Env, fmt: FP4Format, args: argparse.Namespace,
                 random_share: float) -> None:
        fp4 = FP4Precision(fmt=fmt.kind, mx_mode=fmt.mx_mode, compute_dtype=torch.bfloat16)
        backend = "sim" if next(model.parameters()).device.type == "cpu" else "auto"
        self.engines = {True: Engine(copy.deepcopy(model), fp4, backend=backend),
                        False: Engine(copy.deepcopy(model), "bf16", backend=backend)}
        self.tokenizer, self.env, self.args, self.random_share = tokenizer, env, args, random_share

    def rollouts(self, fp4: bool, step: int) -> Rollouts:
        a, tok = self.args, self.tokenizer
        prompts, problems = make_prompts(tok, self.env, a.prompts, a.seed * 7919 + step, self.random_share)
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                seed=a.seed * 1_000_003 + step, stop_token_ids=[tok.eos_id])
        out = self.engines[fp4].generate(prompts, params, capture=CaptureSpec(mode="full") if fp4 else None)
        return align(out, tok, self.env, problems)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start, fmt = time.perf_counter(), parse_format(args.fmt)
    model, tokenizer, env, loss = prepare_policy(args)
    trained = args.train_steps > 0 or args.checkpoint is not None
    share = args.random_prompts if args.random_prompts is not None else (0.0 if trained else 0.5)
    sampler = Sampler(model, tokenizer, env, fmt, args, share)
    variants, layer_audit = method_variants(model.config, fmt), {}
    if args.policies:  # ranked on a batch the table never measures
        layer_audit = audit_layers(model, sampler.rollouts(True, AUDIT_STEP), fmt)
        variants += policy_variants(model.config, fmt, layer_audit)
    rows, rewards, n_tokens = [Row(v) for v in variants], [], 0
    for step in range(args.steps):
        batches = {True: sampler.rollouts(True, step), False: sampler.rollouts(False, step)}
        rewards += batches[True].rewards
        n_tokens += int(batches[True].response_mask.sum())
        for row in rows:
            measure(model, row, batches[row.variant.rollout_fp4], fmt, args.temperature)
    results = [row.result() for row in rows]

    print(f"# {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
          f"{'checkpoint ' + args.checkpoint if args.checkpoint else 'random init'}, train steps {args.train_steps} "
          f"(last loss {loss:.3g}); {args.fmt} rollout in bf16, training fp32; {args.steps} x {args.prompts} prompts "
          f"({share:.0%} random tokens, {args.env}), {n_tokens} FP4 response tokens, FP4 reward/mean "
          f"{sum(rewards) / max(len(rewards), 1):.3f}; seed {args.seed}; {args.device}; "
          f"{time.perf_counter() - start:.0f} s")
    if layer_audit:
        print("# auto ranking audit (fp4_qat code agreement per layer): "
              + ", ".join(f"{k}: {a:.4f}" for k, a in layer_audit.items()))
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
