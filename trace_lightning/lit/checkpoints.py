"""Reading trace-rl checkpoints with one-line errors that name the file and what it is not.

Given to Lightning or torch directly, a missing file, random bytes, a bare weights file or another model's
checkpoint end in a traceback (an unpickling essay, `KeyError: 'pytorch-lightning_version'`, a state_dict diff of
hundreds of keys). Both `--ckpt_path` (checked by the CLI) and `--model.init_from` read through here first.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trace_lightning.model import MoEConfig, Transformer

EXAMPLE = "runs/<run>/version_N/checkpoints/last.ckpt"


class CheckpointFileError(ValueError):
    """A file given as a trace-rl checkpoint that is missing, unreadable, or holds something else."""


def _reason(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:160]}"


def read_checkpoint(path: str | Path, flag: str, *, lightning: bool = False, resume: bool = False) -> dict[str, Any]:
    """The checkpoint dict of a trace-rl checkpoint file (a 'state_dict' holding 'policy.*' tensors); lightning: it
    must also be one Lightning can restore (its version key), resume: and hold the optimizer and loop state a fit
    resumes from. Tensors are memory-mapped, so checking a large checkpoint reads little."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFileError(f"{flag} {path}: no such file (a trace-rl checkpoint, e.g. {EXAMPLE})")
    if not path.is_file():
        raise CheckpointFileError(f"{flag} {path}: not a file (a trace-rl checkpoint is one file, e.g. {EXAMPLE})")
    if not zipfile.is_zipfile(path):
        raise CheckpointFileError(f"{flag} {path}: not a trace-rl checkpoint (not a torch zip archive, as "
                                  "torch.save writes)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 (torch raises many types for foreign bytes)
        raise CheckpointFileError(f"{flag} {path}: not a trace-rl checkpoint (torch.load failed: {_reason(err)})"
                                  ) from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict) \
            or ((lightning or resume) and "pytorch-lightning_version" not in ckpt):
        raise CheckpointFileError(f"{flag} {path}: a bare weights file, not a trace-rl checkpoint (no Lightning "
                                  f"'state_dict'); use a checkpoint that `trace-rl fit` wrote, e.g. {EXAMPLE}")
    if not policy_weights(ckpt):
        raise CheckpointFileError(f"{flag} {path}: holds no policy weights ('policy.*' keys in its state_dict): a "
                                  "checkpoint of another model")
    if resume and not ("optimizer_states" in ckpt and "loops" in ckpt):
        raise CheckpointFileError(f"{flag} {path}: holds weights only (no optimizer or loop state), so a fit cannot "
                                  "resume from it; start a new run from its weights with --model.init_from instead")
    return ckpt


def policy_weights(ckpt: dict[str, Any]) -> dict[str, Tensor]:
    """The `policy.*` tensors of a checkpoint, under the policy's own names."""
    return {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items()
            if isinstance(k, str) and k.startswith("policy.")}


def check_fits(weights: dict[str, Tensor], expected: dict[str, torch.Size], where: str, model: str) -> None:
    """CheckpointFileError naming the first missing, unexpected or mis-shaped tensor unless the weights fit."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [(k, tuple(weights[k].shape), tuple(s)) for k, s in expected.items()
             if k in weights and tuple(weights[k].shape) != tuple(s)]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing (e.g. {missing[0]!r})"] if missing else []
        parts += [f"{len(unexpected)} unexpected (e.g. {unexpected[0]!r})"] if unexpected else []
        parts += [f"{wrong[0][0]!r} is {wrong[0][1]}, the model's is {wrong[0][2]}"] if wrong else []
        raise CheckpointFileError(f"{where}: a checkpoint of another model, its weights do not fit {model}: "
                                  + "; ".join(parts))


def expected_shapes(model: str, checkpoint: str | None) -> dict[str, torch.Size]:
    """The policy's tensor shapes for a preset or a Hugging Face checkpoint folder, without allocating weights."""
    from trace_lightning.model.hf import config_from_hf

    config = config_from_hf(checkpoint) if checkpoint else MoEConfig.from_name(model)
    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(config).state_dict().items()}
