"""Run the RL fit for each training method and write a results table and curves.

All methods share one supervised warm start (trained once and kept under --out; each method then
starts from its weights with `--model.init_from`), so they differ only in the RL phase: how the
rollout quantizes and how training follows it. Results go to docs/results.md (section "RL runs") and docs/figures/*.png.

    python tools/run_methods.py --methods bf16 fp4_naive fp4_qat fp4_qat_tis trace trace_compact \
        --seeds 0 --warmup-steps 250 --rl-steps 100

On a GPU, stack its config on the CPU run's and name the section and the machine:

    python tools/run_methods.py --config conf/gpu.yaml --methods bf16 fp4_qat trace_compact --warmup-steps 300 \
        --rl-steps 200 --name gpu --machine "1x H200"
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: list[str] = []
"""Configs stacked on conf/sim.yaml (--config), e.g. conf/gpu.yaml."""


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


def run_method(method: str, seed: int, warm_ckpt: Path, out: Path, rl_steps: int) -> dict:
    """One method's RL phase and its summary; a finished one is read back from out/<name>.json (a later call
    resumes a comparison that an earlier one, e.g. a time-limited device call, left half done)."""
    name = f"{method}_s{seed}"
    done = out / f"{name}.json"
    if done.exists():
        summary = json.loads(done.read_text())
        if summary.get("rl_steps") == rl_steps and summary.get("warm_start") == str(warm_ckpt):
            return summary
    fit([
        "--model.trace.method", method, "--model.seed", str(seed), "--model.warmup_steps", "0",
        "--model.init_from", str(warm_ckpt), "--trainer.max_steps", str(rl_steps),
        "--trainer.val_check_interval", str(rl_steps // 2),
        "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name,
    ])
    s = scalars(latest_version(out, name))
    reward = [v for _, v in s.get("reward/mean", [])]
    k3 = [v for _, v in s.get("mismatch/k3_kl", [])]
    tail = reward[-max(1, len(reward) // 5):]
    summary = {
        "method": method,
        "seed": seed,
        "rl_steps": rl_steps,
        "warm_start": str(warm_ckpt),
        "first_reward": sum(reward[:5]) / max(1, len(reward[:5])),
        "final_reward": sum(tail) / max(1, len(tail)),
        "mean_k3_kl": sum(k3) / max(1, len(k3)),
        "fp4_accuracy": s.get("eval/accuracy", [(0, float("nan"))])[-1][1],
        "bf16_accuracy": s.get("eval/bf16_accuracy", [(0, float("nan"))])[-1][1],
        "curves": {"reward": s.get("reward/mean", []), "k3_kl": s.get("mismatch/k3_kl", [])},
    }
    done.write_text(json.dumps(summary))
    return summary


def plot(results: list[dict], key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        steps, values = zip(*r["curves"][key], strict=True) if r["curves"][key] else ((), ())
        ax.plot(steps, values, label=f"{r['method']} s{r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    if key == "k3_kl":
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(name: str) -> str:
    return "## RL runs (tools/run_methods.py)" if name == "sim" else f"## RL runs, {name} (tools/run_methods.py)"


def write_results(results: list[dict], command: str, warmup: int, rl_steps: int, name: str, machine: str) -> None:
    ptq = [r["fp4_accuracy"] for r in results if r["method"] == "bf16"]
    lines = [
        section(name),
        "",
        f"Command: `{command}` ({datetime.date.today()}, {machine}; configs: conf/sim.yaml "
        f"{' '.join(CONFIGS)}; {warmup} shared warm-start steps, then {rl_steps} RL steps per method). `ptq` = the",
        "bf16 method's policy quantized post hoc by the FP4 engine.",
        "",
        "| method | seed | reward (first 5 RL steps) | final reward | mean k3_kl | FP4 accuracy | BF16 accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['method']} | {r['seed']} | {r['first_reward']:.3f} | {r['final_reward']:.3f} | "
            f"{r['mean_k3_kl']:.2e} | {r['fp4_accuracy']:.3f} | {r['bf16_accuracy']:.3f} |"
        )
    if ptq:
        lines += ["", f"ptq accuracy (bf16-trained, FP4 post hoc): {sum(ptq) / len(ptq):.3f}"]
    prefix = "" if name == "sim" else f"{name}_"
    lines += ["", f"![reward](figures/{prefix}rl_reward.png)", "", f"![k3_kl](figures/{prefix}rl_k3_kl.png)", ""]
    path = ROOT / "docs" / "results.md"
    text = path.read_text() if path.exists() else "# Results\n\n"
    text = re.sub(re.escape(section(name)) + r".*?(?=\n## |\Z)", "", text, flags=re.S).rstrip() + "\n\n"
    path.write_text(text + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+",
                        default=["bf16", "fp4_naive", "fp4_qat", "fp4_qat_tis", "trace", "trace_compact"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--warmup-steps", type=int, default=250)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "methods")
    parser.add_argument("--config", action="append", default=[], help="a config stacked on conf/sim.yaml (repeatable)")
    parser.add_argument("--name", default="sim", help="results section and figure prefix (sim: the CPU run's)")
    parser.add_argument("--machine", default="2-core CPU", help="where it ran, for the results text")
    args = parser.parse_args()
    CONFIGS.extend(args.config)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    results = []
    for seed in args.seeds:
        warm = args.out / f"warm_s{seed}"
        if not glob.glob(str(warm / "sim" / "version_*" / "checkpoints" / "*.ckpt")):
            fit(["--model.seed", str(seed), "--model.warmup_steps", str(args.warmup_steps),
                "--trainer.max_steps", str(args.warmup_steps), "--trainer.logger.init_args.save_dir", str(warm),
                "--trainer.logger.init_args.name", "sim",
                "--trainer.val_check_interval", str(args.warmup_steps)])
        ckpt = Path(max(glob.glob(str(warm / "sim" / "version_*" / "checkpoints" / "*.ckpt")), key=os.path.getmtime))
        for method in args.methods:
            results.append(run_method(method, seed, ckpt, args.out, args.rl_steps))
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("curves", "warm_start")}),
                  flush=True)
    prefix = "" if args.name == "sim" else f"{args.name}_"
    for key, figure in (("reward", "rl_reward.png"), ("k3_kl", "rl_k3_kl.png")):
        plot(results, key, ROOT / "docs" / "figures" / f"{prefix}{figure}")
    command = "python tools/run_methods.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("out", "machine") and v)
    write_results(results, command, args.warmup_steps, args.rl_steps, args.name, args.machine)


if __name__ == "__main__":
    main()
