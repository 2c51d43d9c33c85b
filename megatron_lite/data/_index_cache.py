"""Index arrays cached beside the data: keyed by a hash of the config, built once (global rank 0), mmap-loaded."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_lite.utils.files import locked, write_atomic

# bump when the layout or the meaning of a cached array changes, so old caches are not reused
CACHE_VERSION = 1


def describe(config: dict[str, Any]) -> tuple[str, str]:
    """(JSON description, MD5 of it): the description is stored beside the arrays, the hash names them."""
    text = json.dumps({"cache_version": CACHE_VERSION, **config}, sort_keys=True, indent=2)
    return text, hashlib.md5(text.encode()).hexdigest()


def array_digest(array: np.ndarray) -> str:
    """Content hash of an index array (e.g. the document ids of a split) for a cache description."""
    return hashlib.md5(np.ascontiguousarray(array).tobytes()).hexdigest()


def _distributed() -> tuple[bool, int]:
    """(initialised, global rank) of the default process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return True, torch.distributed.get_rank()
    return False, 0


def _writable(cache_dir: str) -> bool:
    """Whether ``cache_dir`` exists or can be created, and can be written."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError:
        return False
    return os.access(cache_dir, os.W_OK)


def load_or_build(
    cache_dir: str,
    kind: str,
    description: str,
    digest: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The arrays ``names`` for one config: loaded (mmap) from ``cache_dir`` or built by ``build`` and saved.

    Under an initialised process group global rank 0 builds while every rank waits at a barrier (every rank
    calls it exactly once, hit or miss, so the collective always matches); a rank that still finds no files
    afterwards (no shared filesystem) builds its own copy, which is identical because building is
    deterministic. An unwritable ``cache_dir`` falls back to building in memory on every rank, with a warning.
    """
    base = os.path.join(cache_dir, f"{digest}-{kind}")
    paths = {name: f"{base}-{name}.npy" for name in names}
    description_path = f"{base}-description.json"

    def hit() -> bool:
        if not all(os.path.isfile(p) for p in (*paths.values(), description_path)):
            return False
        with open(description_path, encoding="utf-8") as f:
            # a hash collision (or a hand-edited file) must not hand out another config's indices
            return f.read() == description

    def build_and_save() -> None:
        # the barrier orders ranks of one process group; the lock makes processes outside it build once too
        with locked(base + ".lock"):
            if hit():
                return
            arrays = build()
            for name, path in paths.items():
                write_atomic(path, lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
            # the description is written last: its presence (with matching text) marks a complete entry
            write_atomic(description_path, lambda f: f.write(description.encode()))

    distributed, rank = _distributed()
    if distributed:
        failure: BaseException | None = None
        if rank == 0 and _writable(cache_dir) and not hit():
            try:
                build_and_save()
            except Exception as err:  # re-raised after the barrier, so the other ranks do not hang in it
                failure = err
        torch.distributed.barrier()
        if failure is not None:
            raise failure
    if not _writable(cache_dir):
        warnings.warn(
            f"cannot write the {kind} index cache {cache_dir}; building the indices in memory (again on every "
            f"run). Pass a writable cache_dir to cache them.",
            stacklevel=3,
        )
        return build()
    if not hit():
        build_and_save()
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}
