"""tools/bench_fit_rollout.py on the simulator run's config: the standalone side does the fit's work, token for
token."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_standalone_side_generates_the_fits_tokens_at_its_lengths() -> None:
    spec = importlib.util.spec_from_file_location("bench_fit_rollout", ROOT / "tools" / "bench_fit_rollout.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    threads = torch.get_num_threads()
    try:
        module, data = tool.build([str(ROOT / "conf" / "sim.yaml")], None, "cpu")
        fit, same, fixed = tool.step_rows(module, data, step=3, fixed=True)
    finally:
        torch.set_num_threads(threads)
    r = module.rollout_cfg
    assert fit["side"].startswith("fit") and same["side"] == "standalone, same lengths"
    # the same seeds, prompts and lengths, without the stop token: every row samples the fit's response again
    assert same["same_tokens"] == 1.0 and fixed["same_tokens"] == 1.0
    assert same["new"] == fit["new"] <= fixed["new"] == r.prompts_per_step * r.group_size * r.max_new_tokens
    assert same["steps"] == fit["steps"] and fit["s"] > 0 and same["s"] > 0
