"""Where a `trace-rl` command logs: one folder per run that says what it is, resumes that continue their run.

A fit logs to ``runs/<method>-<task>-<model>/version_N`` (``runs/trace_compact-arithmetic-debug-moe/version_0``),
so after a few commands ``tensorboard --logdir runs`` lists runs by what they are, not one pile of versions. A fit
resumed from a checkpoint inside a run folder (``--ckpt_path runs/R/version_N/checkpoints/last.ckpt``) logs on in
that same version: one run, one set of curves, and its checkpoints stay where they were. ``validate`` and
``predict`` write no run folder unless ``--log_run true`` asks for one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

VERSION_DIR = re.compile(r"^version_(\d+)$")


def _get(node: Any, key: str) -> Any:
    return node.get(key) if node is not None and hasattr(node, "get") else None


def run_name(config: Any) -> str:
    """``<method>-<task>-<model>`` of a subcommand's config; the model is a checkpoint folder's name where one is
    loaded (``trace_compact-arithmetic-Qwen3-30B-A3B``), else the preset's; the task of the reasoning_gym env is its
    dataset's name (``trace_compact-countdown-debug-moe``)."""
    model = config.model
    method = _get(_get(model, "trace"), "method") or "trace_compact"
    task = _get(config.data, "env") or "arithmetic"
    if task == "reasoning_gym":
        task = _get(_get(config.data, "env_kwargs"), "dataset") or task
    checkpoint = _get(model, "checkpoint")
    name = Path(str(checkpoint).rstrip("/")).name if checkpoint else _get(model, "model") or "debug-moe"
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", part) for part in (method, task, name))


def run_of_checkpoint(ckpt_path: str | Path) -> tuple[Path, str, int] | None:
    """(save_dir, name, version) of a checkpoint written into a run folder (save_dir/name/version_N/checkpoints/
    x.ckpt); None for a checkpoint anywhere else."""
    path = Path(ckpt_path)
    if len(path.parents) < 4 or path.parent.name != "checkpoints":
        return None
    version = VERSION_DIR.match(path.parents[1].name)
    if version is None:
        return None
    return path.parents[3], path.parents[2].name, int(version.group(1))


def _run_logger(config: Any) -> Any:
    """The config's RunLogger node (class_path + init_args), or None where another logger (or none) is set."""
    logger = config.trainer.get("logger")
    if logger is None or not hasattr(logger, "get") or "init_args" not in logger:
        return None
    return logger if str(logger.get("class_path", "")).endswith("RunLogger") else None


def place_fit_run(config: Any) -> None:
    """Name a fit's RunLogger after the run (unless named), and point a resume at its checkpoint's run folder."""
    logger = _run_logger(config)
    if logger is None:
        return
    resumed = run_of_checkpoint(config.ckpt_path) if config.get("ckpt_path") else None
    if resumed is not None and logger.init_args.get("version") is None:
        save_dir, name, version = resumed
        configured = Path(logger.init_args.get("save_dir") or "runs")
        if configured.resolve() != save_dir.resolve():  # else keep its spelling: ModelCheckpoint compares dirpaths
            logger.init_args.save_dir = str(save_dir)
        logger.init_args.name, logger.init_args.version = name, version
    elif not logger.init_args.get("name"):
        logger.init_args.name = run_name(config)


def writes_run_folder(subcommand: str | None, config: Any) -> bool:
    """fit (and a CLI built without a subcommand) always logs; validate and predict only when --log_run asks."""
    return subcommand not in ("validate", "predict") or bool(config.get("log_run"))


__all__ = ["place_fit_run", "run_name", "run_of_checkpoint", "writes_run_folder"]
