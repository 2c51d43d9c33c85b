"""A save that runs out of disk: one error that says so, with the bytes needed and free.

What the OS says (ENOSPC, or EDQUOT for a spent quota) would otherwise reach the user as torch's serializer
reports a short write -- ``[enforce fail at inline_container.cc:672] unexpected pos ...`` -- which names
neither the disk nor the checkpoint. The checksumming writer keeps the OS's error of the file it was writing
(:mod:`~megatron_lite.core.checkpoint.format.integrity`); DCP hands every rank's failure to every rank, so every
rank finds the same one and builds :class:`CheckpointDiskFullError` together (:func:`disk_full_error`):
the tensors' bytes are summed over the ranks, and rank 0 removes the unfinished save (giving its space back)
and measures what is free. Nothing was committed: the previous checkpoint and ``latest_checkpoint.json``
are as they were.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_lite.core.checkpoint.errors import CheckpointDiskFullError
from megatron_lite.core.checkpoint.format.commit import LATEST, remove_tree
from megatron_lite.core.checkpoint.format.rank_zero import gather_to_all, on_rank0
from megatron_lite.core.units import format_bytes

DISK_FULL = {errno.ENOSPC: "no space left on device (ENOSPC)", errno.EDQUOT: "disk quota exceeded (EDQUOT)"}


def disk_full_cause(error: Optional[BaseException]) -> Optional[OSError]:
    """The OSError of a full disk behind ``error`` -- itself, its causes, or (a DCP ``CheckpointException``)
    the lowest rank's failure that is one -- else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error
        failures = getattr(error, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for _, (failure, _trace) in sorted(failures.items(), key=lambda item: item[0]):
                found = disk_full_cause(failure)
                if found is not None:
                    return found
        error = error.__cause__ or error.__context__
    return None


def tensor_bytes(state: Any, prefix: str = "") -> dict[str, int]:
    """Bytes of every tensor in a (nested) state dict, by flattened key: a DTensor's global size (what the
    checkpoint stores of it once, whichever ranks hold it)."""
    if isinstance(state, dict):
        out: dict[str, int] = {}
        for key, value in state.items():
            out.update(tensor_bytes(value, f"{prefix}{key}."))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, value in enumerate(state):
            out.update(tensor_bytes(value, f"{prefix}{i}."))
        return out
    if torch.is_tensor(state):
        return {prefix.rstrip("."): state.numel() * state.element_size()}
    return {}


def disk_full_error(
    path: Path, tmp: Path, cause: OSError, local_bytes: dict[str, int], group=None
) -> CheckpointDiskFullError:
    """The error of a save of ``path`` (written into ``tmp``) that ran out of disk; collective (over ``group``
    when given): every rank must call it, and every rank gets the same error. Rank 0 removes ``tmp``."""
    merged: dict[str, int] = {}
    for rank_bytes in gather_to_all(local_bytes, group):
        merged.update(rank_bytes)
    needed = sum(merged.values())
    free, previous = on_rank0(lambda: _give_back_space(path, tmp), group=group)
    assert cause.errno is not None  # a disk-full error (disk_full_cause): ENOSPC or EDQUOT
    what = DISK_FULL[cause.errno]
    where = f" ({cause.filename})" if cause.filename else ""
    space = f"{format_bytes(free)} are free there" if free is not None else "the free space there is unknown"
    kept = f"the previous checkpoint at {path} is unchanged" if previous else f"nothing was written at {path}"
    message = (
        f"{what} while writing the checkpoint {path}{where}. It needs about {format_bytes(needed)} (its "
        f"tensors) and {space} once the unfinished save was removed. Nothing was committed: {kept}, and "
        f"{path.parent / LATEST} names what it named before. Free space on that disk, or save to one with "
        f"more (ModelCheckpoint(dirpath=...)), or keep fewer checkpoints (save_top_k)."
    )
    return CheckpointDiskFullError(cause.errno, message, needed, free)


def _give_back_space(path: Path, tmp: Path) -> tuple[Optional[int], bool]:
    """On rank 0: remove the unfinished save; (bytes free on the file system, whether ``path`` exists)."""
    remove_tree(tmp)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    return free, os.path.lexists(path)
