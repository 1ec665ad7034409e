"""Surviving kills: a stopped fit exits non-zero with a resumable checkpoint, and no checkpoint is ever torn.

Lightning turns SIGTERM into a clean ``SystemExit`` (status 0) after the current batch and saves nothing, and
SIGINT into a ``KeyboardInterrupt`` wherever it lands (possibly mid optimizer step). ``StopOnSignal`` handles
both the same way: the signal only sets a flag, the current step finishes, the callback saves a checkpoint
the run resumes from with ``--ckpt_path``, and the fit leaves with status 128 + signal number, as a process
killed by that signal would. A second SIGINT stops at once (no checkpoint).

Lightning's own writer stages a checkpoint in ``$TMPDIR`` and moves it into place; across filesystems that
move is a copy, and a SIGKILL during it leaves a truncated file under the final name. ``AtomicCheckpointIO``
writes a temporary file beside the target, fsyncs it, and renames it over the target, so a reader sees the
old file or the new one, never part of one.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, fsync it, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (a crash right after it must not bring the old entry back)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint writer for local paths, made atomic (temp file beside the target + rename)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)


class FitInterrupted(SystemExit):
    """A fit stopped by a signal; the exit status is 128 + the signal number."""

    def __init__(self, signum: int, checkpoint: str | None) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpoint = signum, checkpoint


class StopOnSignal(L.Callback):
    """On SIGTERM or SIGINT: finish the current step, save a resumable checkpoint, exit with 128 + signal."""

    def __init__(self, dirpath: str | None = None, filename: str = "interrupted") -> None:
        """
        Args:
            dirpath: Folder of the checkpoint; None: the ModelCheckpoint's folder, else <default_root_dir>/checkpoints.
            filename: Checkpoint file name, without the .ckpt extension.
        """
        self.dirpath, self.filename = dirpath, filename
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    # ---- signal handlers ----------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.signum = signum
        print(f"received {signal.Signals(signum).name}: saving a checkpoint after the current step "
              "(SIGINT again to stop at once)", file=sys.stderr, flush=True)

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        """Installed after Lightning's SIGTERM handler (whose status-0 exit this replaces) and kept until the
        fit leaves, so each handler is put back in the order it was taken."""
        self.signum = None
        for signum in STOP_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: leave signals to whoever owns them
                break

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self._restore()

    # ---- stopping -----------------------------------------------------------------------------------
    def checkpoint_path(self, trainer: L.Trainer) -> Path:
        folder = self.dirpath or getattr(trainer.checkpoint_callback, "dirpath", None)
        folder = folder or os.path.join(trainer.default_root_dir, "checkpoints")
        return Path(folder) / f"{self.filename}.ckpt"

    def _stop(self, trainer: L.Trainer, signum: int) -> FitInterrupted:
        self._restore()
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        print(f"stopped by {signal.Signals(signum).name} after step {trainer.global_step}; resume with "
              f"--ckpt_path {path}", file=sys.stderr, flush=True)
        return FitInterrupted(signum, str(path))

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The step is complete (optimizer stepped, weights synced): a consistent point to save and leave."""
        signum = signal.SIGTERM if self.signum is None and trainer.received_sigterm else self.signum
        if signum is not None:
            raise self._stop(trainer, signum)

    def on_validation_end(self, trainer: L.Trainer, module: Any) -> None:
        """A signal during validation: the step before it is complete, so save here rather than after the next."""
        if self.signum is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            raise self._stop(trainer, self.signum)

    def on_exception(self, trainer: L.Trainer, module: Any, exception: BaseException) -> None:
        """Lightning raises its own status-0 SIGTERMException for a SIGTERM that came before our handler was
        installed: save, and turn its status into the non-zero one of a killed process."""
        self._restore()
        if isinstance(exception, SIGTERMException) and not isinstance(exception, FitInterrupted):
            exception.code = self._stop(trainer, signal.SIGTERM).code
