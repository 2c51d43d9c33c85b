"""Every error a checkpoint can raise, in one leaf module (it imports nothing of ours), so that any part of the
checkpoint code -- and :func:`~megatron_lite.core.checkpoint.format.rank_zero.on_rank0`, which re-raises rank 0's
error on every rank as the same type -- can name them without importing the code that raises them."""

from __future__ import annotations

import pickle
from typing import Any, Optional


class CorruptCheckpointError(ValueError):
    """A checkpoint's files do not match what was written (or it is incomplete)."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)
        """What is wrong, one line per bad file (empty when only the message says it)."""


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file names something outside what its format may contain."""


class CheckpointMetaError(ValueError):
    """A checkpoint's metadata cannot be written or read as the safe JSON encoding allows."""


class CheckpointDiskFullError(OSError):
    """A checkpoint could not be written: its file system is full (ENOSPC) or the user's quota is spent
    (EDQUOT). Nothing was committed; the previous checkpoint is intact."""

    def __init__(self, code: int, message: str, needed: Optional[int] = None, free: Optional[int] = None) -> None:
        super().__init__(code, message)
        self.needed = needed
        """Bytes of the checkpoint's tensors, summed over the ranks (what the save needs, about)."""
        self.free = free
        """Bytes free on the checkpoint's file system once the unfinished save was removed (None: unknown)."""

    def __str__(self) -> str:
        return self.strerror or ""  # always the message: OSError(code, message) sets it


class AsyncCheckpointError(RuntimeError):
    """A checkpoint written in the background could not be written or committed."""


class EntryMismatchError(ValueError):
    """A strict load of a checkpoint whose model entries are not the module's (raised on every rank together)."""

    def __init__(self, message: str, mismatch: Any) -> None:
        super().__init__(message)
        self.mismatch = mismatch
        """The :class:`~megatron_lite.core.checkpoint.resume.entries.EntryMismatch`: the names missing on each side."""


class UnsupportedHFModel(ValueError):
    """An HF model or option that megatron-lite cannot represent (the message names it)."""

    @classmethod
    def config_option(cls, what: str, why: str) -> "UnsupportedHFModel":
        """The refusal of ``what`` in an HF ``config.json``, saying ``why``."""
        return cls(f"HF config: {what} is not supported ({why}).")


SHARED_ACROSS_RANKS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    ValueError,
    TypeError,
    CorruptCheckpointError,
    CheckpointMetaError,
    UnsafeCheckpointError,
)
"""The errors rank 0 raises in a step it does alone that the other ranks re-raise as the same type."""
