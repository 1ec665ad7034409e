"""Checks of a `trace-rl` command line that Lightning would answer with a traceback, or silently ignore.

Each turns a misuse into one line naming the option (printed by `cli.entry`, exit status 2), or makes the
combination work where its meaning is plain (`--trainer.enable_checkpointing false` drops the shipped config's
checkpoint callback instead of stopping at Lightning's conflict). A checkpoint given with `--ckpt_path` is read and
checked before Lightning touches it, and the command line's settings are reconciled with the run's: settings that
define the weights must agree with the checkpoint, other explicit `--model.*` overrides apply.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import yaml

from trace_lightning.lit.checkpoints import check_fits, expected_shapes, policy_weights

GROUPS = {"model.trace": "method", "model.rollout": "max_new_tokens", "model.rl": "clip_eps"}
"""Options that take a mapping of settings, and a field of each to show in the message."""
IDENTITY = ("model", "checkpoint", "trace.method", "trace.fmt")
"""Model settings that define what a checkpoint's weights are: they must agree with the checkpoint's."""
GPU_ACCELERATORS = ("gpu", "cuda")


class CLIError(Exception):
    """A misuse the user fixes on the command line (printed as one line, exit status 2)."""


def _options(argv: list[str]) -> Iterator[tuple[str, str | None]]:
    """(key without the leading dashes, its value or None) for each `--key value` / `--key=value` of argv."""
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        key, eq, value = token[2:].partition("=")
        yield key, value if eq else (argv[i + 1] if i + 1 < len(argv) else None)


def check_group_values(argv: list[str]) -> None:
    """`--model.rollout 5` names a whole settings group with a scalar: say what the option takes."""
    for key, value in _options(argv):
        if key in GROUPS and value is not None:
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = None
            if not isinstance(parsed, dict):
                field = GROUPS[key]
                raise CLIError(f"--{key} takes a mapping of its settings, got {value!r}: set one with "
                               f"--{key}.{field} VALUE, or several with --{key} '{{{field}: VALUE, ...}}'")


def explicit_model_keys(argv: list[str]) -> list[str]:
    """The model settings argv sets itself (`--model.rollout.max_new_tokens 8` -> 'rollout.max_new_tokens')."""
    return [key.removeprefix("model.") for key, _ in _options(argv) if key.startswith("model.")]


def check_accelerator(trainer: Any) -> None:
    """`--trainer.accelerator gpu` where torch sees no CUDA device (Lightning: 'No supported gpu backend found!')."""
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        raise CLIError(f"--trainer.accelerator {accelerator}: torch sees no CUDA GPU on this machine (torch "
                       f"{torch.__version__}, torch.cuda.is_available() is False); use --trainer.accelerator cpu "
                       "(conf/sim.yaml) or run where a GPU is visible")


def check_precision(trainer: Any) -> None:
    """`--trainer.precision bf16-mixed` would autocast the rollout engine's evaluation too (it runs in validation
    steps) and the FP4 emulation with it: the training forward's compute is `--model.train_compute`."""
    precision = str(trainer.get("precision") or "32-true").lower()
    if precision not in ("32", "32-true"):
        raise CLIError(f"--trainer.precision {precision}: trace-rl keeps Lightning at 32-true (its precision plugin "
                       "would also cast the rollout engine's evaluation); use --model.train_compute bf16 for a bf16 "
                       "training forward (the rollout's compute is --model.trace.rollout_compute)")


def drop_checkpoint_callbacks(trainer: Any) -> list[str]:
    """With enable_checkpointing false, remove the config's ModelCheckpoint callbacks (Lightning refuses the pair);
    -> the class paths removed. A signal still saves `interrupted.ckpt` (StopOnSignal needs no ModelCheckpoint)."""
    if trainer.get("enable_checkpointing") is not False or not trainer.get("callbacks"):
        return []
    dropped = [cb.class_path for cb in trainer.callbacks if str(_class_path(cb)).endswith("ModelCheckpoint")]
    trainer.callbacks = [cb for cb in trainer.callbacks if not str(_class_path(cb)).endswith("ModelCheckpoint")]
    return dropped


def _class_path(callback: Any) -> str:
    return callback.get("class_path", "") if hasattr(callback, "get") else type(callback).__name__


def flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'trace': {'method': 'x'}} -> {'trace.method': 'x'}."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_identity(model: Any, hparams: dict[str, Any], path: str) -> None:
    """Refuse settings that redefine the checkpoint's weights (another preset, HF checkpoint, method or format)."""
    saved = flatten(hparams)
    for key in IDENTITY:
        if key in saved and key in model and model[key] != saved[key]:
            raise CLIError(f"--ckpt_path {path} was trained with model.{key} {saved[key]!r} but this command sets "
                           f"{model[key]!r}: --ckpt_path takes the run's settings from the checkpoint, so pass "
                           f"--model.{key} {saved[key]} (or drop the override), or start a new run from its weights "
                           f"with --model.init_from {path}")


def check_checkpoint_fits(model: Any, ckpt: dict[str, Any], path: str) -> None:
    """The checkpoint's policy weights fit the model its settings describe (not a checkpoint of another model)."""
    name = model.get("checkpoint") or model.get("model")
    check_fits(policy_weights(ckpt), expected_shapes(model.get("model"), model.get("checkpoint")),
               f"--ckpt_path {path}", str(name))
