"""``ckpt_path="last"`` under MegatronStrategy: resume the newest *valid* checkpoint of the run's checkpoint
directories, or start from the beginning only when there is none.

Lightning resolves ``"last"`` in every rank to the newest ``last*.ckpt`` by modification time: it starts
from step 0 when there is no ``last.ckpt`` even while other finished checkpoints are there, and a corrupted
``last.ckpt`` fails the run. So before Lightning sees the argument, :func:`replace_last` turns ``"last"`` into

- the checkpoint callback's directory when it holds a finished checkpoint (decided from the file system
  alone, see ``core/checkpoint/auto_resume``). The strategy's ``load_checkpoint`` recognises it and calls
  :func:`resume_checkpoint`: collectively, the newest checkpoint whose files pass their checksums, with a
  warning naming each one skipped and why;
- ``None`` when there is no finished checkpoint (a warning names the unfinished saves, if any): the fit
  starts from the beginning.

Where it runs: the launchers call it with the arguments of ``trainer.fit`` (and validate/test/predict) --
the fork/spawn/popen launchers in the launching process, before any rank starts, and an in-place launcher
in every rank that torchrun, SLURM or the popen launcher started. Lightning hands a launcher those
arguments before its ``_fit_impl`` resolves ``ckpt_path``: the only point where our code sees them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format.commit import clean_up
from megatron_lite.core.checkpoint.resume.auto_resume import (
    has_finished_checkpoint,
    newest_valid_checkpoint,
    unfinished_checkpoints,
)
from megatron_lite.core.object_store import Location, is_remote
from megatron_lite.strategies._lightning_private import checkpoint_callback_dir

LAST = "last"

log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    # A warning-level log record from rank 0: visible without any logging set-up, and kept by a forked rank
    # (a Python warning there is swallowed when the launching process records warnings, as pytest does).
    if rank_zero_only.rank == 0:
        log.warning(message)


@dataclasses.dataclass(frozen=True)
class AutoResume:
    """A ``ckpt_path="last"`` that was replaced: where its checkpoints are, and the path Lightning got instead."""

    directories: tuple[str, ...]
    """The checkpoint directories of the run's checkpoint callbacks."""
    requested: str
    """What ``load_checkpoint`` receives for it (the first of ``directories`` holding a finished checkpoint)."""


def checkpoint_directories(trainer: Any) -> list[str]:
    """The directories the Trainer's checkpoint callbacks save into (ModelCheckpoint's ``dirpath``,
    OnExceptionCheckpoint's), in order, without repeats."""
    found: dict[str, str] = {}
    callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or [])
    callbacks += [c for c in getattr(trainer, "callbacks", None) or [] if isinstance(c, OnExceptionCheckpoint)]
    for callback in callbacks:
        directory = checkpoint_callback_dir(callback, trainer)
        if directory is not None:
            found.setdefault(str(directory) if is_remote(directory) else os.path.abspath(directory), str(directory))
    return list(found.values())


def _ckpt_path_index(args: tuple) -> Optional[int]:
    # The only str or path among the positional arguments of Lightning's _fit_impl/_validate_impl/...
    return next((i for i, a in enumerate(args) if isinstance(a, (str, os.PathLike))), None)


def replace_last(args: tuple, trainer: Any, fitting: bool) -> tuple[tuple, Optional[AutoResume]]:
    """``args`` with ``ckpt_path="last"`` replaced (see the module docstring), and what ``load_checkpoint``
    needs to resolve it; ``args`` unchanged for any other ``ckpt_path``, or when the Trainer has no checkpoint
    callback (Lightning then says that there is no last checkpoint). File system only: runs before any
    process group exists, and every rank reaches the same answer."""
    index = _ckpt_path_index(args)
    if index is None or str(args[index]) != LAST:
        return args, None
    directories = checkpoint_directories(trainer)
    if not directories:
        return args, None
    holding = [d for d in directories if has_finished_checkpoint([d])]
    if holding:
        resume = AutoResume(tuple(directories), holding[0])
        return (*args[:index], resume.requested, *args[index + 1 :]), resume
    if not fitting:
        return args, None  # validate/test/predict: Lightning's own "last" (none found: the given model as it is)
    where = ", ".join(directories)
    unfinished = unfinished_checkpoints(directories)
    if unfinished:
        _warn(
            f"megatron-lite: ckpt_path='last' found no finished checkpoint in {where}; training starts "
            f"from the beginning. Not resumable:\n" + "\n".join(f"  {s.path}: {s.reason}" for s in unfinished)
        )
    else:
        rank_zero_info(
            f"megatron-lite: ckpt_path='last': no checkpoint in {where} yet; training starts from the beginning."
        )
    return (*args[:index], None, *args[index + 1 :]), None


def resume_checkpoint(resume: AutoResume) -> Location:
    """The checkpoint to load for ``resume``: the newest one whose files all pass their checks, the others
    named in a warning with what is wrong with them. Collective; raises one clear error on every rank when
    every checkpoint there is damaged (the fit was about to resume, so it never trains from step 0 silently)."""
    choice = newest_valid_checkpoint(resume.directories)
    if choice.skipped:
        _warn(
            "megatron-lite: ckpt_path='last' skipped checkpoints that cannot be resumed:\n"
            + "\n".join(f"  {s.path}: {s.reason}" for s in choice.skipped)
            + (f"\nResuming the newest valid one, {choice.checkpoint}." if choice.checkpoint else "")
        )
    if choice.checkpoint is None:
        raise CorruptCheckpointError(
            f"ckpt_path='last': no checkpoint in {', '.join(resume.directories)} passed its checks, so nothing was "
            f"loaded:\n"
            + "\n".join(f"  {s.path}: {s.reason}" for s in choice.skipped)
            + "\nMove the damaged checkpoints away (or copy them again from where they came from) and run again -- "
            "with none left, training starts from the beginning -- or pass ckpt_path= a checkpoint to load."
        )
    if not choice.verified:
        _warn(
            f"megatron-lite: {choice.checkpoint} has no manifest.json (written before checksums existed, "
            f"or by plain DCP); its files are loaded without an integrity check."
        )
    return choice.checkpoint


def recover_interrupted_saves(trainer: Any) -> None:
    """In the launching process, before any rank resolves ``ckpt_path="last"``: where a save was killed while
    replacing a checkpoint on a file system that cannot exchange two names atomically, put the complete one
    back under its name, and remove leftovers of killed saves (ModelCheckpoint directories given by dirpath)."""
    for callback in getattr(trainer, "checkpoint_callbacks", []) if trainer is not None else []:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath and os.path.isdir(dirpath):
            clean_up(dirpath)
