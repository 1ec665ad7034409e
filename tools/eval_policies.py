"""Evaluate the final policies of a method sweep with less noise than the fit's own eval.

A fit's eval is one greedy pass over `data.eval_size` held-out draws: at accuracy 0.8 over 256 draws its binomial
standard deviation is 0.025, as large as the PTQ gap (0.025) that issue 41 asks trace_compact to beat. This tool
scores each run's last checkpoint on every *distinct* held-out problem, greedily and with K samples at the rollout
temperature (the quantity GRPO optimises), by the FP4 engine and by the BF16 engine, and pairs each method with the
bf16 run of its seed: its FP4 numbers against PTQ (the bf16 policy run by the FP4 engine).

  python tools/eval_policies.py --runs runs/sweep_long runs/sweep_long_ckpt --samples 32 --json out.json
  python tools/eval_policies.py --report out.json [more.json ...]

Runs are `<method>_s<seed>/version_*/checkpoints/last.ckpt` under each --runs directory (tools/run_methods.py's
layout); a (method, seed) found twice keeps the first directory's. Scored runs already in --json are not redone.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trace_lightning.envs import Env, Problem, make_env, score_responses  # noqa: E402
from trace_lightning.lit.checkpoints import policy_weights, read_checkpoint  # noqa: E402
from trace_lightning.lit.config import RolloutConfig, TraceConfig  # noqa: E402
from trace_lightning.lit.policy import build_policy  # noqa: E402
from trace_lightning.lit.worker import RolloutWorker  # noqa: E402
from trace_lightning.methods import get_method  # noqa: E402

ENGINES = {"fp4": "fp4_naive", "bf16": "bf16"}
"""Which method's rollout precision each engine runs (the fit's eval uses the same two)."""
RUN_NAME = re.compile(r"^(?P<method>.+)_s(?P<seed>\d+)$")
EVAL_SEED = 10**9
"""Sampling seeds of the evaluation (rollouts of a fit never use these)."""


def find_runs(dirs: list[Path]) -> dict[tuple[str, int], Path]:
    """(method, seed) -> the newest last.ckpt of that run, first directory first."""
    runs: dict[tuple[str, int], Path] = {}
    for d in dirs:
        for run in sorted(p for p in d.iterdir() if p.is_dir() and RUN_NAME.match(p.name)):
            m = RUN_NAME.match(run.name)
            ckpts = sorted(run.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
            key = (m["method"], int(m["seed"]))
            if ckpts and key not in runs:
                runs[key] = ckpts[-1]
    return runs


def distinct_problems(env: Env) -> list[Problem]:
    """Every distinct held-out problem (by prompt) once, in a fixed order."""
    size = getattr(env, "size", None)
    if size is None:
        raise ValueError(f"env {type(env).__name__} has no finite item set to enumerate")
    seen: dict[str, Problem] = {}
    for i in range(size):
        p = env.problem(i)
        seen.setdefault(p.prompt, p)
    return sorted(seen.values(), key=lambda p: p.prompt)


def hit_rate(worker: RolloutWorker, env: Env, problems: list[Problem], samples: int, greedy: bool,
             batch: int = 1024) -> float:
    """Mean reward over every problem, `samples` rollouts each (greedy: one)."""
    reps = 1 if greedy else samples
    rows = [p for p in problems for _ in range(reps)]
    rewards: list[float] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        out = worker.generate([worker.encode_prompt(p) for p in chunk], seed=EVAL_SEED + start, greedy=greedy)
        texts = [worker.decode_response(r) for r in out.responses]
        rewards += score_responses(env, chunk, texts).rewards
    return sum(rewards) / len(rewards)


def evaluate(ckpt_path: Path, env: Env, problems: list[Problem], samples: int, fmt: str | None = None
             ) -> dict[str, Any]:
    """Greedy and sampled accuracy of one checkpoint's policy, by each engine, and the FP4 engine's format: `fmt`, or
    by default the run's own trace.fmt."""
    ckpt = read_checkpoint(ckpt_path, "--runs")
    hp = ckpt["hyper_parameters"]
    policy, tokenizer = build_policy(hp["model"], hp.get("checkpoint"))
    policy.load_state_dict(policy_weights(ckpt))
    policy.eval().requires_grad_(False)
    rollout = RolloutConfig(**hp["rollout"])
    fmt = fmt or hp["trace"]["fmt"]
    scores: dict[str, Any] = {"fmt": fmt}
    for engine, method in ENGINES.items():
        trace = TraceConfig(**{**hp["trace"], "method": method, "fmt": fmt})
        worker = RolloutWorker(policy, tokenizer, get_method(method), trace, rollout)
        scores[f"{engine}_greedy"] = hit_rate(worker, env, problems, samples, greedy=True)
        scores[f"{engine}_sampled"] = hit_rate(worker, env, problems, samples, greedy=False)
    return scores


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    above = sum(v > 0 for v in values)
    se = sd / math.sqrt(len(values))
    return f"{statistics.fmean(values):+.3f} +- {sd:.3f} (se {se:.3f}; > 0 on {above}/{len(values)})"


def report(results: list[dict[str, Any]]) -> list[str]:
    """Per method and FP4 format: mean accuracies, and paired differences against PTQ, the same seed's bf16 policy on
    an FP4 engine of the same format."""
    by = {(r["method"], r["seed"], r["fmt"]): r for r in results}
    methods = sorted({(r["method"], r["fmt"]) for r in results}, key=lambda m: (m[0] != "bf16", m))
    columns, paired = ("fp4_greedy", "fp4_sampled", "bf16_greedy", "bf16_sampled"), ("fp4_greedy", "fp4_sampled")
    lines = ["| method | seeds | FP4 greedy | FP4 sampled | BF16 greedy | BF16 sampled | FP4 greedy - ptq (paired) | "
             "FP4 sampled - ptq (paired) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    formats = {fmt for _, fmt in methods}
    for method, fmt in methods:
        rows = sorted((r for r in results if (r["method"], r["fmt"]) == (method, fmt)), key=lambda r: r["seed"])
        ptq = [(r, by[("bf16", r["seed"], fmt)]) for r in rows if ("bf16", r["seed"], fmt) in by]
        means = " | ".join(f"{statistics.fmean(r[k] for r in rows):.3f}" for k in columns)
        diffs = " | ".join(spread([r[k] - b[k] for r, b in ptq]) for k in paired)
        if method == "bf16":
            diffs = "(ptq) | (ptq)"
        name = method if len(formats) == 1 else f"{method} ({fmt})"
        lines.append(f"| {name} | {len(rows)} | {means} | {diffs} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="*", type=Path, default=[], help="sweep directories (tools/run_methods.py --out)")
    p.add_argument("--config", default=str(ROOT / "conf" / "sim.yaml"), help="the fits' config (its data: section)")
    p.add_argument("--samples", type=int, default=32, help="rollouts per problem at the rollout temperature")
    p.add_argument("--methods", nargs="*", default=None, help="only these methods (default: every run found)")
    p.add_argument("--fmt", default=None, help="the FP4 engine's format, e.g. mxfp4 (default: each run's trace.fmt); "
                   "PTQ in another format than the bf16 runs were evaluated in")
    p.add_argument("--json", type=Path, default=None, help="results file: read (finished runs skipped), then written")
    p.add_argument("--report", nargs="*", type=Path, default=None, help="report these results files; score nothing")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    if args.report is not None:
        results = [r for f in args.report for r in json.loads(f.read_text())["runs"]]
        print("\n".join(report(results)))
        return
    data = OmegaConf.to_container(OmegaConf.load(args.config)).get("data", {})
    config_name = str(Path(args.config).resolve().relative_to(ROOT)) if Path(args.config).resolve().is_relative_to(
        ROOT) else args.config
    env = make_env(data.get("env", "arithmetic"), **(data.get("env_kwargs") or {}))
    env = env.held_out() if callable(getattr(env, "held_out", None)) else env
    problems = distinct_problems(env)
    done = json.loads(args.json.read_text())["runs"] if args.json and args.json.exists() else []
    scored = {(r["method"], r["seed"]) for r in done}
    torch.set_num_threads(1)
    for (method, seed), ckpt in sorted(find_runs(args.runs).items()):
        if (method, seed) in scored or (args.methods and method not in args.methods):
            continue
        row = {"method": method, "seed": seed, "checkpoint": str(ckpt), "problems": len(problems),
               "samples": args.samples, **evaluate(ckpt, env, problems, args.samples, args.fmt)}
        print(json.dumps(row), flush=True)
        done.append(row)
        if args.json:
            args.json.write_text(json.dumps({"config": config_name, "runs": done}, indent=1))
    print("\n".join(report(done)))


if __name__ == "__main__":
    main()
