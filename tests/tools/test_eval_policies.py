"""tools/eval_policies.py: every distinct held-out problem once, the paired differences against PTQ, and a sweep's
checkpoints scored end to end (a scored run is read back, not redone)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ev = _load("eval_policies", ROOT / "tools" / "eval_policies.py")


def test_distinct_problems_are_every_held_out_prompt_once() -> None:
    from trace_lightning.envs import make_env

    env = make_env("arithmetic").held_out()
    problems = ev.distinct_problems(env)
    prompts = [p.prompt for p in problems]
    assert len(set(prompts)) == len(prompts) == len({env.problem(i).prompt for i in range(env.size)})
    assert prompts == sorted(prompts)
    for p in problems:  # "7-3=": Python's own arithmetic is the oracle of the env's answers
        assert int(p.answer) == eval(p.prompt.removesuffix("="))  # noqa: S307 - digits and +/- only, asserted below
        assert set(p.prompt) <= set("0123456789+-=")


def test_paired_differences_are_against_the_same_seeds_ptq() -> None:
    def row(method: str, seed: int, fp4: float, fmt: str = "nvfp4") -> dict:
        return {"method": method, "seed": seed, "fmt": fmt, "fp4_greedy": fp4, "fp4_sampled": fp4 - 0.1,
                "bf16_greedy": fp4, "bf16_sampled": fp4}

    results = [row("bf16", 0, 0.70), row("bf16", 1, 0.80), row("trace_compact", 0, 0.75), row("trace_compact", 1, 0.78),
               row("trace_compact", 2, 0.99)]  # seed 2 has no bf16 run: left out of the pairs
    lines = ev.report(results)
    mixed = ev.report(results + [row("bf16", 2, 0.5, fmt="mxfp4")])  # PTQ in another format: not a pair
    assert next(line for line in mixed if line.startswith("| trace_compact (nvfp4) |")) == lines[3].replace(
        "| trace_compact |", "| trace_compact (nvfp4) |")
    tc = next(line for line in lines if line.startswith("| trace_compact |"))
    # (0.75 - 0.70, 0.78 - 0.80) = (+0.05, -0.02): mean +0.015, sample std 0.0495, se 0.035, above on 1 of 2
    assert "| +0.015 +- 0.049 (se 0.035; > 0 on 1/2) |" in tc
    assert tc.startswith("| trace_compact | 3 | 0.840 | 0.740 | 0.840 | 0.840 |")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep directory whose bf16_s0 and trace_compact_s0 runs hold the same one-step checkpoint."""
    conftest = _load("lit_conftest", ROOT / "tests" / "lit" / "conftest.py")
    runs = tmp_path_factory.mktemp("sweep")
    ckpt = runs / "bf16_s0" / "version_0" / "checkpoints" / "last.ckpt"
    conftest.one_step_checkpoint(ckpt)
    twin = runs / "trace_compact_s0" / "version_0" / "checkpoints"
    twin.mkdir(parents=True)
    shutil.copy(ckpt, twin / "last.ckpt")
    (runs / "warm_s0").mkdir()  # not a <method>_s<seed> run
    return runs


def test_a_sweep_is_scored_and_a_scored_run_is_not_redone(sweep: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "eval.json"
    ev.main(["--runs", str(sweep), "--samples", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["runs"]
    assert sorted((r["method"], r["seed"]) for r in rows) == [("bf16", 0), ("trace_compact", 0)]
    bf16, tc = sorted(rows, key=lambda r: r["method"])
    for key in ("fp4_greedy", "fp4_sampled", "bf16_greedy", "bf16_sampled"):
        assert 0.0 <= bf16[key] <= 1.0
        assert tc[key] == bf16[key]  # the same weights score the same, sampling seeds included
    assert bf16["problems"] == len(ev.distinct_problems(ev.make_env("arithmetic").held_out()))

    def refuse(*args: object) -> None:
        raise AssertionError("a scored run was evaluated again")

    monkeypatch.setattr(ev, "evaluate", refuse)
    ev.main(["--runs", str(sweep), "--samples", "2", "--json", str(out)])
    assert len(json.loads(out.read_text())["runs"]) == 2


def test_samples_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ev.main(["--samples", "0"])
    assert "--samples must be >= 1, got 0" in capsys.readouterr().err


def test_the_fp4_engine_takes_the_format_asked_for(sweep: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--fmt mxfp4 scores the policies on an MXFP4 engine (PTQ in another format); the BF16 engine is unchanged."""
    built: list[tuple[str, str]] = []
    worker = ev.RolloutWorker

    def recording(policy, tokenizer, method, trace, rollout):  # noqa: ANN001, ANN202
        built.append((method.name, trace.fmt))
        return worker(policy, tokenizer, method, trace, rollout)

    monkeypatch.setattr(ev, "RolloutWorker", recording)
    nv, mx = tmp_path / "nv.json", tmp_path / "mx.json"
    ev.main(["--runs", str(sweep), "--samples", "2", "--methods", "bf16", "--json", str(nv)])
    ev.main(["--runs", str(sweep), "--samples", "2", "--methods", "bf16", "--fmt", "mxfp4", "--json", str(mx)])
    (a,), (b,) = json.loads(nv.read_text())["runs"], json.loads(mx.read_text())["runs"]
    assert (a["fmt"], b["fmt"]) == ("nvfp4", "mxfp4")
    assert (a["bf16_greedy"], a["bf16_sampled"]) == (b["bf16_greedy"], b["bf16_sampled"])
    assert built == [("fp4_naive", "nvfp4"), ("bf16", "nvfp4"), ("fp4_naive", "mxfp4"), ("bf16", "mxfp4")]
