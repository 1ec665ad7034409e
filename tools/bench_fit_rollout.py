"""The fit's rollout against the standalone engine at the same lengths (issue 23: in-fit >= 50% of standalone).

The fit's side is `RolloutWorker.rollout`, built from the fit's own configs by trace-rl's parser on the device:
what a training step runs and logs as `rollout/tokens_per_s` (the step's problems, group_size samples each, the
method's capture; a typical step, not an audit one). Its responses end at the policy's stop token, so the length mix
depends on the weights: pass a checkpoint of the fit (--init-from, e.g. runs/gpu/trace_compact/version_0/
checkpoints/last.ckpt) to see that fit's mix. The standalone side is `Engine.generate` on the same engine, prompts,
seeds and capture with every row's max_new_tokens set to the length its response had and no stop token: the same
tokens per row and the same decode steps, with nothing of the fit around it (tools/bench_engine.py's measurement at
those lengths; `--fixed` adds bench_engine's own shape, every row to max_new_tokens).

Run: python tools/bench_fit_rollout.py --config conf/sim.yaml --config conf/gpu.yaml [--init-from CKPT] [--steps 4]
     python tools/bench_fit_rollout.py --config conf/sim.yaml --steps 2          (CPU, the simulator run's shape)
Both sides are timed as the worker times itself: wall time around the generate call, which ends with the host
transfer of the tokens (a device sync). Means leave out the first step (kernel compilation).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from trace_lightning.lit.callbacks import DepthSelectiveCompaction
from trace_lightning.lit.cli import main as trace_cli
from trace_lightning.rollout import RolloutBatch


def build(configs: list[str], init_from: str | None, device: str, overrides: list[str] = ()) -> tuple[Any, Any]:
    """The fit's PolicyModule and RLDataModule from its configs and `KEY=VALUE` overrides (trace-rl's options, e.g.
    model.rollout.prompts_per_step=8), no Trainer run, no run folder, on `device`."""
    args = [arg for config in configs for arg in ("--config", config)] + ["--trainer.logger", "false"]
    args += [arg for kv in overrides for arg in (f"--{kv.split('=', 1)[0]}", kv.split("=", 1)[1])]
    if init_from:
        args += ["--model.init_from", init_from]
    cli = trace_cli(args, run=False)
    module = cli.model.to(device)
    module.worker.sync(module.named_weights_for_sync(), module.policy_version)  # the engine, on the device
    DepthSelectiveCompaction().apply(module)  # the recorded layers of the fit's first step
    return module, cli.datamodule


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def step_rows(module: Any, data: Any, step: int, fixed: bool) -> list[dict[str, Any]]:
    """The fit's rollout of `step` and the standalone engine at its lengths (and at max_new_tokens with --fixed)."""
    worker, r = module.worker, module.rollout_cfg
    worker.audit_next = False  # a typical step: the configured records, not an audit's full codes of every layer
    problems, seeds = data.step_rollouts(module, step)
    capture = worker.capture_spec()
    batch = worker.rollout(data.env, problems, seed=seeds)
    stats = batch.rollout_stats
    lengths = batch.response_mask.sum(dim=1).tolist()
    prompts = worker.group_prompts(problems)
    responses = [batch.tokens[i, len(p) : len(p) + n].tolist()
                 for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    rows = [{"side": "fit (worker.rollout)", "s": stats["time/rollout_s"], "new": sum(lengths),
             "steps": stats["rollout/decode_steps"], "prefill_s": stats["rollout/prefill_s"],
             "capture_s": stats["rollout/graph_capture_s"], "same_tokens": 1.0}]
    same = dataclasses.replace(worker.sampling_params(seeds), max_new_tokens=lengths, stop_token_ids=[])
    cases = [("standalone, same lengths", same)]
    if fixed:
        cases.append(("standalone, every row to max_new_tokens",
                      dataclasses.replace(same, max_new_tokens=r.max_new_tokens)))
    for side, params in cases:
        out, seconds = timed(lambda p=params: worker.engine.generate(prompts, p, capture=capture,
                                                                     max_batch=r.max_batch))
        assert isinstance(out, RolloutBatch)
        rows.append({"side": side, "s": seconds, "new": sum(len(x) for x in out.responses),
                     "steps": out.stats["decode_steps"], "prefill_s": out.stats["prefill_s"],
                     "capture_s": out.stats["capture_s"],
                     "same_tokens": statistics.mean(a[: len(b)] == b
                                                    for a, b in zip(out.responses, responses, strict=True))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="a fit config (repeat to stack, as trace-rl)")
    parser.add_argument("--init-from", default=None, help="a trace-rl checkpoint of the fit (its policy weights)")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps (the first is left out of the means)")
    parser.add_argument("--fixed", action="store_true", help="also every row to max_new_tokens (bench_engine's shape)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trace-rl option override")
    args = parser.parse_args()
    module, data = build(args.config, args.init_from, args.device, args.set)
    engine = module.worker.engine
    print(f"{engine.config.name} on {args.device} ({engine.ops.__name__}, precision {engine.precision}), "
          f"{module.rollout_cfg.prompts_per_step} x {module.rollout_cfg.group_size} rollouts, "
          f"max_new_tokens {module.rollout_cfg.max_new_tokens}, capture {module.worker.capture_spec()}")
    print("| step | side | new tokens | decode steps | tok/s | ms / decode step | prefill ms | capture ms | rows with "
          "the fit's tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    by_side: dict[str, list[dict[str, Any]]] = {}
    for step in range(args.steps):
        for row in step_rows(module, data, step, args.fixed):
            by_side.setdefault(row["side"], []).append(row)
            print(f"| {step} | {row['side']} | {row['new']} | {row['steps']:.0f} | {row['new'] / row['s']:.0f} | "
                  f"{1e3 * row['s'] / row['steps']:.2f} | {1e3 * row['prefill_s']:.1f} | "
                  f"{1e3 * row['capture_s']:.1f} | {row['same_tokens']:.0%} |")
    later = {side: rows[1:] or rows for side, rows in by_side.items()}
    tok_s = {side: statistics.mean(r["new"] / r["s"] for r in rows) for side, rows in later.items()}
    fit, same = tok_s["fit (worker.rollout)"], tok_s["standalone, same lengths"]
    print(f"\nmeans over steps {1 if args.steps > 1 else 0}..{args.steps - 1}: "
          + ", ".join(f"{side} {v:.0f} tok/s" for side, v in tok_s.items())
          + f"; fit / standalone at the same lengths: {fit / same:.0%}")


if __name__ == "__main__":
    main()
