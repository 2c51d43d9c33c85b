"""Checks of what ``trainer.fit/validate/test/predict`` was given beyond the module and the data, run in
the launching process before any rank starts: the checkpoint to resume and the callbacks' own checks.
A bad ``ckpt_path`` used to surface inside every rank, after the process groups existed, as DCP's error."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

# ckpt_path values that Lightning resolves itself (a checkpoint callback's file, the HPC path, a model registry)
_SYMBOLIC = ("last", "best", "hpc")


def ckpt_path_of(arguments: Iterable[Any]) -> Optional[str]:
    """The checkpoint path among the positional arguments of Lightning's ``_fit_impl`` / ``_validate_impl`` /
    ``_test_impl`` / ``_predict_impl`` (the only str or path among them)."""
    return next((str(a) for a in arguments if isinstance(a, (str, os.PathLike))), None)


def check_ckpt_path(value: Optional[str]) -> None:
    """A path that Lightning does not resolve itself must be a megatron-lite checkpoint directory."""
    if value is None or value in _SYMBOLIC or value.startswith("registry"):
        return
    path = Path(value)
    fix = ("pass the directory that trainer.save_checkpoint() or ModelCheckpoint wrote, or ckpt_path='last' to "
           "resume the newest checkpoint in the checkpoint callback's directory")
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={value!r} does not exist; {fix}")
    if not path.is_dir():
        raise ValueError(f"ckpt_path={value!r} is a file, not a megatron-lite checkpoint directory (DCP shards and "
                         f"meta.pt; a single-file checkpoint comes from another strategy); {fix}")
    if not (path / ".metadata").is_file():
        raise ValueError(f"ckpt_path={value!r} is not a megatron-lite checkpoint directory (no DCP .metadata inside); "
                         f"{fix}")


def check_callbacks(trainer: Any, module: Any) -> None:
    """Run each callback's ``validate_run(trainer, module)``, if it has one (raises naming the fix)."""
    for callback in getattr(trainer, "callbacks", None) or []:
        check = getattr(callback, "validate_run", None)
        if callable(check):
            check(trainer, module)
