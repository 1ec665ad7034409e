"""A run's TensorBoard scalars in one table: per tag, how many points, the first, the last, the mean and the max.

For reading a fit's numbers where no browser is (a device machine): the step-time breakdown (time/*), the
rollout and training throughput, sync time, peak memory, the agreement and mismatch metrics.

Run: python tools/tb_summary.py runs/gpu/trace_compact/version_0 [--match time/ rollout/ quant/] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def summarize(run: Path, match: list[str]) -> dict[str, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in sorted(acc.Tags()["scalars"]):
        if match and not any(m in tag for m in match):
            continue
        values = [e.value for e in acc.Scalars(tag)]
        finite = [v for v in values if math.isfinite(v)]
        out[tag] = {"n": len(values), "first": values[0], "last": values[-1],
                    "mean": sum(finite) / len(finite) if finite else math.nan, "max": max(finite, default=math.nan)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a version_N directory (or any directory holding its event file)")
    parser.add_argument("--match", nargs="*", default=[], help="keep tags containing any of these")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = summarize(args.run, args.match)
    print("| tag | n | first | last | mean | max |\n|---|---|---|---|---|---|")
    for tag, r in rows.items():
        print(f"| {tag} | {r['n']} | {r['first']:.4g} | {r['last']:.4g} | {r['mean']:.4g} | {r['max']:.4g} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
