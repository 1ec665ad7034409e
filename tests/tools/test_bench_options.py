"""tools/_bench.py's kernel option flags: what bench_rollout.py / bench_kernels.py pass down as KernelOptions."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("_bench", Path(__file__).resolve().parents[2] / "tools" / "_bench.py")
assert _SPEC is not None and _SPEC.loader is not None
_bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_bench)


def options_of(*argv: str):  # noqa: ANN201 (a KernelOptions)
    parser = argparse.ArgumentParser()
    _bench.add_kernel_option_args(parser)
    return _bench.kernel_options_from(parser.parse_args(argv))


def test_no_flags_are_the_kernels_defaults() -> None:
    assert options_of() == _bench.kernels.KernelOptions()


def test_flags_set_autotune_pdl_and_one_attention_shape() -> None:
    options = options_of("--autotune", "--no-pdl", "--attention-shape", "32,1,3,12")
    assert options.autotune and not options.pdl
    assert options.attention == _bench.kernels.AttentionLaunch(32, 1, 3)
    assert options.attention_long is None and options.attention_programs_per_sm == 12


def test_a_shape_of_three_numbers_is_refused() -> None:
    with pytest.raises(SystemExit, match="keys,warps,stages,per_sm"):
        options_of("--attention-shape", "64,2,3")
