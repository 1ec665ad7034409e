"""Run the RL fit for each training method over several seeds; merge the per-run files into a table and curves.

Every seed gets one supervised warm start (trained once and kept under --out); each method then starts from its
weights with `--model.init_from`, so methods differ only in the RL phase: how the rollout quantizes and how training
follows it. Each (method, seed) run writes its own summary, --out/<method>_s<seed>.json, holding the device the
program found, so a comparison is resumable (a finished run is read back, not rerun) and mergeable (a later call, or
one on another machine, adds seeds; `--report` merges every file of --out and of --merge without fitting).
The report (stdout, docs/results.md, docs/figures/<prefix>rl_*.png) gives, per method, the mean +- standard deviation
and min/max over seeds of the final reward (mean of the last 20% of RL steps) and of the FP4 and BF16 eval accuracy,
with `ptq` (the bf16 method's policy evaluated by the FP4 engine, i.e. quantized after training) as its own row.

    python tools/run_methods.py --seeds 0 1 2 3 4 --warmup-steps 100 --rl-steps 100 -- --data.eval_size 256 \\
        --trainer.limit_val_batches 8

Arguments after `--` go to every fit (warm start and RL). On a GPU, stack its config on the CPU run's and name the
section; bring the JSON files back and merge them:

    python tools/run_methods.py --config conf/gpu.yaml --methods bf16 fp4_qat trace_compact --warmup-steps 300 \\
        --rl-steps 200 --name gpu --out runs/methods_gpu
    python tools/run_methods.py --report --name gpu --out runs/methods_gpu --merge /path/to/fetched/jsons
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: list[str] = []
"""Configs stacked on conf/sim.yaml (--config), e.g. conf/gpu.yaml."""
METHODS = ["bf16", "fp4_naive", "fp4_qat", "fp4_qat_tis", "fp4_qat_icepop", "trace", "trace_compact"]
SUMMARY_KEYS = ("final_reward", "fp4_accuracy", "bf16_accuracy", "mean_k3_kl")


def device_label() -> str:
    """The device this process runs on, as found: the CUDA device's name (and count), else the CPU model and the cores
    this process may use."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU {model} ({cores} cores)"


def fit(args: list[str]) -> None:
    from trace_lightning.lit.cli import main

    stacked = [arg for config in CONFIGS for arg in ("--config", config)]
    main(["fit", "--config", str(ROOT / "conf" / "sim.yaml"), *stacked, *args])


def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def latest_version(save_dir: Path, name: str) -> str:
    return max(glob.glob(str(save_dir / name / "version_*")), key=lambda p: int(p.rsplit("_", 1)[1]))


def tail_mean(values: list[float], fraction: float = 0.2) -> float:
    """Mean of the last `fraction` of values (at least one); nan for none."""
    if not values:
        return math.nan
    tail = values[-max(1, round(len(values) * fraction)):]
    return sum(tail) / len(tail)


def summarize(s: dict[str, list[tuple[int, float]]], **fields: Any) -> dict:
    """One run's summary from its logged scalars; `fields` (method, seed, setting, ...) are stored with it."""
    reward = [v for _, v in s.get("reward/mean", [])]
    k3 = [v for _, v in s.get("mismatch/k3_kl", [])]
    last = lambda tag: s[tag][-1][1] if s.get(tag) else math.nan  # noqa: E731
    return {
        **fields,
        "first_reward": sum(reward[:5]) / len(reward[:5]) if reward else math.nan,
        "final_reward": tail_mean(reward),
        "mean_k3_kl": sum(k3) / len(k3) if k3 else math.nan,
        "fp4_accuracy": last("eval/accuracy"),
        "bf16_accuracy": last("eval/bf16_accuracy"),
        "curves": {"reward": s.get("reward/mean", []), "k3_kl": s.get("mismatch/k3_kl", [])},
    }


def setting(warmup: int, rl_steps: int, fit_args: list[str]) -> dict:
    """What makes two runs comparable: a run is resumed or merged only into the same setting."""
    return {"warmup_steps": warmup, "rl_steps": rl_steps, "configs": list(CONFIGS), "fit_args": list(fit_args)}


def checkpoint_step(path: str) -> int:
    """The optimizer steps a Lightning checkpoint holds (-1 if unreadable)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except Exception:  # noqa: BLE001 - a half-written or foreign file is simply not a finished warm start
        return -1


def warm_start(seed: int, warmup: int, out: Path, fit_args: list[str]) -> tuple[Path, dict]:
    """The seed's warm-start checkpoint (trained here once) and its eval accuracies."""
    warm = out / f"warm_s{seed}"
    pattern = str(warm / "sim" / "version_*" / "checkpoints" / "*.ckpt")
    if not any(checkpoint_step(path) == warmup for path in glob.glob(pattern)):  # a cut-off one holds fewer steps
        fit(["--model.seed", str(seed), "--model.warmup_steps", str(warmup), "--trainer.max_steps", str(warmup),
             "--trainer.logger.init_args.save_dir", str(warm), "--trainer.logger.init_args.name", "sim",
             "--trainer.val_check_interval", str(warmup), *fit_args])
    s = scalars(latest_version(warm, "sim"))
    finished = [path for path in glob.glob(pattern) if checkpoint_step(path) == warmup]
    evals = {"warm_fp4_accuracy": s["eval/accuracy"][-1][1] if s.get("eval/accuracy") else math.nan,
             "warm_bf16_accuracy": s["eval/bf16_accuracy"][-1][1] if s.get("eval/bf16_accuracy") else math.nan}
    return Path(max(finished, key=os.path.getmtime)), evals


def run_method(method: str, seed: int, warm: tuple[Path, dict], out: Path, rl_steps: int, run_setting: dict,
               fit_args: list[str]) -> dict:
    """One method's RL phase and its summary, written to out/<method>_s<seed>.json; a finished run of the same
    setting is read back instead (a later call resumes what an earlier one, e.g. a time-limited call, left undone)."""
    name = f"{method}_s{seed}"
    done = out / f"{name}.json"
    if done.exists():
        summary = json.loads(done.read_text())
        if summary.get("setting") == run_setting:
            return summary
    ckpt, warm_evals = warm
    fit([
        "--model.trace.method", method, "--model.seed", str(seed), "--model.warmup_steps", "0",
        "--model.init_from", str(ckpt), "--trainer.max_steps", str(rl_steps),
        "--trainer.val_check_interval", str(rl_steps),
        "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name, *fit_args,
    ])
    summary = summarize(scalars(latest_version(out, name)), method=method, seed=seed, setting=run_setting,
                        device=device_label(), date=datetime.date.today().isoformat(), **warm_evals)
    done.write_text(json.dumps(summary))
    return summary


def load_results(dirs: list[Path]) -> list[dict]:
    """Every <method>_s<seed>.json under dirs; a (method, seed) found twice keeps the first directory's."""
    results: dict[tuple[str, int], dict] = {}
    for d in dirs:
        for path in sorted(d.glob("*_s*.json")):
            r = json.loads(path.read_text())
            if "method" in r and "seed" in r:
                results.setdefault((r["method"], r["seed"]), r)
    return sorted(results.values(), key=lambda r: (r["method"], r["seed"]))


def spread(values: list[float]) -> dict[str, float]:
    """n, mean, sample standard deviation (0 for one value), min and max of the finite values."""
    v = [x for x in values if isinstance(x, int | float) and math.isfinite(x)]
    if not v:
        return {"n": 0, "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"n": len(v), "mean": mean, "std": std, "min": min(v), "max": max(v)}


def aggregate(results: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per method (and `ptq`, the bf16 runs' FP4-engine accuracy): the spread of each summary value over seeds."""
    methods = sorted({r["method"] for r in results}, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS))
    table = {m: {k: spread([r[k] for r in results if r["method"] == m]) for k in SUMMARY_KEYS} for m in methods}
    bf16 = [r for r in results if r["method"] == "bf16"]
    if bf16:
        nan = spread([])
        table["ptq"] = {"final_reward": nan, "mean_k3_kl": nan, "bf16_accuracy": nan,
                        "fp4_accuracy": spread([r["fp4_accuracy"] for r in bf16])}
    return table


def paired(results: list[dict], method: str, key: str, ref_key: str | None = None) -> dict[str, float]:
    """Spread over seeds of method's `key` minus the bf16 run's `ref_key` (default: the same key) on the same seed:
    both start from that seed's warm start, so the difference removes the warm start's seed-to-seed spread."""
    ref = {r["seed"]: r[ref_key or key] for r in results if r["method"] == "bf16"}
    return spread([r[key] - ref[r["seed"]] for r in results if r["method"] == method and r["seed"] in ref])


def cell(s: dict[str, float], fmt: str = ".3f") -> str:
    if s["n"] == 0:
        return "-"
    return f"{s['mean']:{fmt}} +- {s['std']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def table_lines(table: dict[str, dict[str, dict[str, float]]], results: list[dict] | None = None) -> list[str]:
    """The markdown table; with `results`, two paired columns against bf16 on the same seeds: final reward minus
    bf16's, and FP4 accuracy minus ptq's (the bf16 run's FP4 accuracy)."""
    lines = ["| method | seeds | final reward | FP4 accuracy | BF16 accuracy | mean k3_kl |",
             "| --- | --- | --- | --- | --- | --- |"]
    if results is not None:
        lines = [lines[0] + " reward - bf16 (paired) | FP4 accuracy - ptq (paired) |", lines[1] + " --- | --- |"]
    for m, row in table.items():
        n = max(s["n"] for s in row.values())
        k3 = row["mean_k3_kl"]
        line = (f"| {m} | {n} | {cell(row['final_reward'])} | {cell(row['fp4_accuracy'])} | "
                f"{cell(row['bf16_accuracy'])} | {'-' if k3['n'] == 0 else format(k3['mean'], '.2e')} |")
        if results is not None:
            own = m not in ("bf16", "ptq")
            line += (f" {cell(paired(results, m, 'final_reward')) if own else '-'} |"
                     f" {cell(paired(results, m, 'fp4_accuracy')) if own else '-'} |")
        lines.append(line)
    return lines


def banded(results: list[dict], key: str) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Per method: steps, mean and standard deviation over the seeds that logged that step."""
    out = {}
    for m in sorted({r["method"] for r in results}):
        by_step: dict[int, list[float]] = {}
        for r in results:
            if r["method"] == m:
                for step, value in r["curves"][key]:
                    by_step.setdefault(step, []).append(value)
        steps = sorted(by_step)
        stats = [spread(by_step[s]) for s in steps]
        out[m] = (steps, [s["mean"] for s in stats], [s["std"] for s in stats])
    return out


def plot(results: list[dict], key: str, path: Path, smooth: int = 5) -> bool:
    """Mean curve per method with a +-1 std band over seeds (moving average of `smooth` steps); False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def moving(v: list[float]) -> list[float]:
        return [sum(v[max(0, i - smooth + 1):i + 1]) / len(v[max(0, i - smooth + 1):i + 1]) for i in range(len(v))]

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, (steps, mean, std) in banded(results, key).items():
        if not steps:
            continue
        mean, std = moving(mean), moving(std)
        (line,) = ax.plot(steps, mean, label=m, lw=1.2)
        ax.fill_between(steps, [a - b for a, b in zip(mean, std, strict=True)],
                        [a + b for a, b in zip(mean, std, strict=True)], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"{key} (mean +- std over seeds, {smooth}-step average)")
    if key == "k3_kl":
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def section(name: str) -> str:
    return "## RL runs (tools/run_methods.py)" if name == "sim" else f"## RL runs, {name} (tools/run_methods.py)"


def write_results(results: list[dict], command: str, name: str, figures: bool) -> None:
    """Replace the section `name` of docs/results.md with the merged table."""
    devices = sorted({r.get("device", "unrecorded") for r in results})
    dates = sorted({r.get("date", "unrecorded") for r in results})
    settings = {json.dumps(r.get("setting"), sort_keys=True) for r in results}
    lines = [
        section(name), "",
        f"Command: `{command}`; configs: conf/sim.yaml {' '.join(CONFIGS)}. Runs dated {', '.join(dates)}; device as "
        f"found by the program: {'; '.join(devices)}. Setting: {'; '.join(sorted(settings))}.",
        "Cells: mean +- sample std [min, max] over seeds; final reward = mean of the last 20% of RL steps; accuracies "
        "from the last eval. `ptq` = the bf16 method's policy evaluated by the FP4 engine (quantized after training).",
        "Paired columns: per seed, the method's value minus bf16's (ptq's for accuracy) from the same warm start; "
        "mean +- std [min, max] over the seeds both ran.",
        "", *table_lines(aggregate(results), results),
    ]
    if figures:
        prefix = "" if name == "sim" else f"{name}_"
        lines += ["", f"![reward](figures/{prefix}rl_reward.png)", "", f"![k3_kl](figures/{prefix}rl_k3_kl.png)"]
    lines.append("")
    path = ROOT / "docs" / "results.md"
    text = path.read_text() if path.exists() else "# Results\n\n"
    pattern = re.escape(section(name)) + r".*?(?=\n##+ |\Z)"  # up to the next heading: its subsections are kept
    if re.search(pattern, text, flags=re.S):
        text = re.sub(pattern, lambda _: "\n".join(lines), text, count=1, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + "\n".join(lines)
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup-steps", type=int, default=250)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "methods")
    parser.add_argument("--config", action="append", default=[], help="a config stacked on conf/sim.yaml (repeatable)")
    parser.add_argument("--name", default=None,
                        help="results section and figure prefix (sim: the CPU run's); --report defaults to sim, a "
                             "fitting run writes docs/ only when named (a run of some methods or seeds would "
                             "otherwise replace a whole section with its own share)")
    parser.add_argument("--report", action="store_true", help="merge the JSON files and report; fit nothing")
    parser.add_argument("--merge", nargs="*", type=Path, default=[], help="more directories of run JSON files")
    parser.add_argument("--no-docs", action="store_true", help="print the table only (docs/ left alone)")
    argv = list(sys.argv[1:] if argv is None else argv)
    fit_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --methods {unknown}; known: {METHODS}")
    CONFIGS.extend(args.config)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        run_setting = setting(args.warmup_steps, args.rl_steps, fit_args)
        for seed in args.seeds:
            warm = warm_start(seed, args.warmup_steps, args.out, fit_args)
            for method in args.methods:
                r = run_method(method, seed, warm, args.out, args.rl_steps, run_setting, fit_args)
                print(json.dumps({k: v for k, v in r.items() if k not in ("curves", "setting")}), flush=True)
    results = [r for r in load_results([args.out, *args.merge]) if r["method"] in args.methods]
    print("\n".join(table_lines(aggregate(results), results)))
    if args.no_docs or not results:
        return
    if args.name is None and not args.report:
        print("docs/ left alone: pass --name to write a section, or merge every run with --report [--name NAME]")
        return
    args.name = args.name or "sim"
    prefix = "" if args.name == "sim" else f"{args.name}_"
    figures = all([plot(results, key, ROOT / "docs" / "figures" / f"{prefix}{figure}")
                   for key, figure in (("reward", "rl_reward.png"), ("k3_kl", "rl_k3_kl.png"))])
    if not figures:
        print("matplotlib is not installed: no figures")
    command = "python tools/run_methods.py " + " ".join(argv)
    write_results(results, command, args.name, figures)


if __name__ == "__main__":
    main()
