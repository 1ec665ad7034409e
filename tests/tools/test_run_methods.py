"""tools/run_methods.py: the device label, the per-(method, seed) files, their merge and the seed statistics."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "run_methods.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_methods", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rm = _tool()


def _run(method: str, seed: int, reward: float, fp4: float, bf16: float, k3: float = 1e-4) -> dict:
    return {"method": method, "seed": seed, "final_reward": reward, "fp4_accuracy": fp4, "bf16_accuracy": bf16,
            "mean_k3_kl": k3, "curves": {"reward": [(0, reward), (1, reward + 0.1)], "k3_kl": [(0, k3)]},
            "device": "CPU test (2 cores)", "date": "2026-12-05", "setting": {"rl_steps": 2}}


def test_device_label_names_what_was_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    label = rm.device_label()
    assert label.startswith("CPU ") and label.endswith(" cores)")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        if names:
            assert names[0] in label
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    assert rm.device_label() == "2x NVIDIA H100 80GB HBM3"


def test_tail_mean_is_the_last_fifth() -> None:
    assert rm.tail_mean([0.0] * 8 + [1.0, 3.0]) == 2.0  # last 2 of 10
    assert rm.tail_mean([5.0, 7.0]) == 7.0  # at least one value
    assert math.isnan(rm.tail_mean([]))


def test_spread_uses_the_sample_std_and_skips_nan() -> None:
    s = rm.spread([0.2, 0.4, 0.6, math.nan])
    assert s["n"] == 3 and s["min"] == 0.2 and s["max"] == 0.6
    assert s["mean"] == pytest.approx(0.4) and s["std"] == pytest.approx(0.2)
    assert rm.spread([0.5])["std"] == 0.0
    assert rm.spread([])["n"] == 0


def test_summarize_reads_the_logged_scalars() -> None:
    s = {"reward/mean": [(i, float(i)) for i in range(10)], "mismatch/k3_kl": [(0, 1e-3), (1, 3e-3)],
         "eval/accuracy": [(5, 0.25), (9, 0.5)], "eval/bf16_accuracy": [(9, 0.75)]}
    r = rm.summarize(s, method="fp4_qat", seed=3)
    assert r["method"] == "fp4_qat" and r["seed"] == 3
    assert r["first_reward"] == 2.0 and r["final_reward"] == 8.5
    assert r["mean_k3_kl"] == pytest.approx(2e-3)
    assert (r["fp4_accuracy"], r["bf16_accuracy"]) == (0.5, 0.75)


def test_merge_adds_seeds_and_aggregate_has_a_ptq_row(tmp_path: Path) -> None:
    first, later = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    later.mkdir()
    for r in (_run("bf16", 0, 0.5, 0.4, 0.6), _run("trace_compact", 0, 0.55, 0.62, 0.6)):
        (first / f"{r['method']}_s{r['seed']}.json").write_text(json.dumps(r))
    for r in (_run("bf16", 1, 0.7, 0.5, 0.7), _run("bf16", 0, 9.0, 9.0, 9.0)):  # seed 0 again: the first dir's wins
        (later / f"{r['method']}_s{r['seed']}.json").write_text(json.dumps(r))
    (first / "warm_s0.json").write_text("{}")  # not a run summary
    results = rm.load_results([first, later])
    assert [(r["method"], r["seed"]) for r in results] == [("bf16", 0), ("bf16", 1), ("trace_compact", 0)]
    table = rm.aggregate(results)
    assert list(table) == ["bf16", "trace_compact", "ptq"]
    assert table["bf16"]["final_reward"]["mean"] == pytest.approx(0.6)
    assert table["ptq"]["fp4_accuracy"]["mean"] == pytest.approx(0.45)
    assert table["ptq"]["final_reward"]["n"] == 0
    lines = rm.table_lines(table)
    assert lines[2].startswith("| bf16 | 2 | 0.600 +- 0.141 [0.500, 0.700] | 0.450 +- 0.071 [0.400, 0.500] |")
    assert lines[4] == "| ptq | 2 | - | 0.450 +- 0.071 [0.400, 0.500] | - | - |"
    steps, mean, std = rm.banded(results, "reward")["bf16"]
    assert steps == [0, 1] and mean == pytest.approx([0.6, 0.7]) and std[0] == pytest.approx(0.1414, abs=1e-4)


def test_a_finished_run_is_read_back_not_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = rm.setting(10, 20, ["--data.eval_size", "256"])
    done = {**_run("fp4_qat", 2, 0.3, 0.3, 0.3), "setting": setting}
    (tmp_path / "fp4_qat_s2.json").write_text(json.dumps(done))

    def no_fit(args: list[str]) -> None:
        raise AssertionError("a finished run was fitted again")

    monkeypatch.setattr(rm, "fit", no_fit)
    warm = (tmp_path / "warm.ckpt", {})
    assert rm.run_method("fp4_qat", 2, warm, tmp_path, 20, setting, [])["final_reward"] == 0.3
    with pytest.raises(AssertionError, match="fitted again"):  # another setting is not the same run
        rm.run_method("fp4_qat", 2, warm, tmp_path, 40, rm.setting(10, 40, []), [])


def test_unknown_method_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rm.main(["--methods", "fp5", "--report", "--no-docs"])
    assert "unknown --methods ['fp5']" in capsys.readouterr().err


def test_a_cut_off_warm_start_is_not_taken_for_a_finished_one(tmp_path: Path) -> None:
    import torch

    torch.save({"global_step": 125, "state_dict": {}}, tmp_path / "last.ckpt")
    (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
    assert rm.checkpoint_step(str(tmp_path / "last.ckpt")) == 125
    assert rm.checkpoint_step(str(tmp_path / "broken.ckpt")) == -1


def test_paired_differences_are_taken_seed_by_seed() -> None:
    results = [_run("bf16", 0, 0.5, 0.4, 0.6), _run("bf16", 1, 0.9, 0.8, 0.9),
               _run("fp4_qat", 0, 0.4, 0.5, 0.6), _run("fp4_qat", 1, 0.7, 0.8, 0.9), _run("fp4_qat", 2, 0.1, 0.1, 0.1)]
    reward = rm.paired(results, "fp4_qat", "final_reward")  # seed 2 has no bf16 run: left out
    assert reward["n"] == 2 and reward["mean"] == pytest.approx(-0.15) and reward["min"] == pytest.approx(-0.2)
    accuracy = rm.paired(results, "fp4_qat", "fp4_accuracy")
    assert accuracy["mean"] == pytest.approx(0.05) and accuracy["max"] == pytest.approx(0.1)
    lines = rm.table_lines(rm.aggregate(results), results)
    row = next(line for line in lines if line.startswith("| fp4_qat |"))
    assert row.endswith("| -0.150 +- 0.071 [-0.200, -0.100] | 0.050 +- 0.071 [0.000, 0.100] |")


def test_a_report_replaces_its_table_and_keeps_the_sections_reading(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\n## RL runs, x (tools/run_methods.py)\n\nold table\n\n"
                                     "### Reading the runs\n\nwritten by hand\n\n## Next\n\nkept too\n")
    monkeypatch.setattr(rm, "ROOT", tmp_path)
    rm.write_results([_run("bf16", 0, 0.5, 0.4, 0.6)], "cmd", "x", figures=False)
    text = (docs / "results.md").read_text()
    assert "old table" not in text and "| bf16 | 1 |" in text
    assert "### Reading the runs\n\nwritten by hand" in text and "## Next\n\nkept too" in text


def test_a_fitting_run_writes_docs_only_when_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run of two methods once replaced the whole CPU section with its own share: unnamed, it prints its table."""
    written: list[str] = []
    monkeypatch.setattr(rm, "warm_start", lambda seed, steps, out, fit_args: (out / "warm.ckpt", {}))
    monkeypatch.setattr(rm, "run_method", lambda method, seed, *a: _run(method, seed, 0.5, 0.4, 0.6))
    monkeypatch.setattr(rm, "load_results", lambda dirs: [_run("fp4_qat_tis", 0, 0.5, 0.4, 0.6)])
    monkeypatch.setattr(rm, "plot", lambda *a: False)
    monkeypatch.setattr(rm, "write_results", lambda results, command, name, figures: written.append(name))
    rm.main(["--methods", "fp4_qat_tis", "--out", str(tmp_path)])
    assert written == [] and "docs/ left alone" in capsys.readouterr().out
    rm.main(["--methods", "fp4_qat_tis", "--out", str(tmp_path), "--name", "probe"])
    rm.main(["--methods", "fp4_qat_tis", "--out", str(tmp_path), "--report"])
    assert written == ["probe", "sim"]
