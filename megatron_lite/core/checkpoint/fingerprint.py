"""Where a model's weights came from: a directory's path and a hash of its contents.

``GPTModule.from_pretrained(path)`` records what it loaded (:class:`LoadedWeights`, hashed when first needed), and a
LoRA run's checkpoint records its :class:`WeightsSource` instead of the frozen base it did not save
(:mod:`megatron_lite.core.checkpoint.adapter_only`): whoever loads that checkpoint finds the base again and can tell
whether it is still the same.

The hash is cheap and deterministic: for one of our checkpoints, SHA-256 over its ``manifest.json``'s records (every
file's name, size and CRC-32, which the save computed while writing: nothing is re-read); for a Hugging Face
directory (or a checkpoint without a manifest), SHA-256 over its weight files' names and bytes. A model at an
object-store URL is recorded by its URL and hashed the same way, from the local copy of its small files (ours) or of
the whole directory (Hugging Face) that :func:`~megatron_lite.core.checkpoint.remote_source.local_files` makes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from megatron_lite.core.checkpoint.format.integrity import MANIFEST
from megatron_lite.core.object_staging import objects_under
from megatron_lite.core.object_store import is_remote, location

_CHUNK = 8 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp")


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """A directory of weights and its content hash (see the module docstring)."""

    path: str
    """The directory as it was given (absolute), or its URL."""
    sha256: str
    """The hash of its contents (:func:`weights_hash`)."""

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}

    @classmethod
    def from_json(cls, record: Any) -> "WeightsSource":
        if not isinstance(record, dict) or not isinstance(record.get("path"), str) or "sha256" not in record:
            raise ValueError(f"not a weights source record: {record!r}")
        return cls(record["path"], str(record["sha256"]))


def weights_hash(path: str | os.PathLike) -> str:
    """The content hash of the weights directory (or URL) ``path`` (see the module docstring)."""
    path = _local(path)
    digest = hashlib.sha256()
    manifest = path / MANIFEST
    if manifest.is_file():
        files = json.loads(manifest.read_text()).get("files", {})
        for name in sorted(files):
            record = files[name]
            digest.update(f"{name}\0{record.get('bytes')}\0{record.get('crc32')}\n".encode())
        return digest.hexdigest()
    weights = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise ValueError(f"{path} holds no weight files to fingerprint")
    for file in weights:
        digest.update(f"{file.name}\0".encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def weights_source(path: str | os.PathLike) -> WeightsSource:
    """The :class:`WeightsSource` of the weights directory ``path`` as it is now."""
    return WeightsSource(_named(path), weights_hash(path))


def _named(path: str | os.PathLike) -> str:
    """How a source is recorded: a local path made absolute, a URL as it is."""
    return str(location(path)) if is_remote(path) else str(Path(path).absolute())


def _local(path: str | os.PathLike) -> Path:
    """``path``, or the local copy of what is at the URL ``path`` that its hash is computed from."""
    from megatron_lite.core.checkpoint.remote_source import local_files  # reads checkpoints: imported when needed

    return local_files(path)


class LoadedWeights:
    """The directory a module's weights were loaded from, hashed only when a LoRA run first needs its
    :class:`WeightsSource` (hashing a Hugging Face directory reads every weight file: seconds per GB, which a plain
    ``from_pretrained`` for generation or full fine-tuning should not pay).

    The weight files' names, sizes and modification times are noted at load; if they differ when the hash is asked
    for, the files are no longer what was loaded and there is no source (:meth:`source` returns None)."""

    def __init__(self, path: str | os.PathLike, sha256: Optional[str] = None) -> None:
        """``sha256``: the directory's hash if the caller has just computed it (not computed again)."""
        self.path = _named(path)
        self._stamp = _stamp(self.path)
        self._source: Optional[WeightsSource] = WeightsSource(self.path, sha256) if sha256 is not None else None

    def source(self) -> Optional[WeightsSource]:
        """The loaded directory's :class:`WeightsSource` (hashed at the first call), or None if its files changed
        since they were loaded."""
        if self._source is None:
            if _stamp(self.path) != self._stamp:
                return None
            self._source = WeightsSource(self.path, weights_hash(self.path))
        return self._source


def _stamp(path: str) -> tuple:
    """(name, size, mtime) of the files :func:`weights_hash` reads in ``path`` (its manifest, or its weight files);
    at a URL, (name, size, ETag) of every object under it."""
    directory = Path(path)
    try:
        if is_remote(path):
            return tuple(sorted(objects_under(path).items()))
        files = [directory / MANIFEST] if (directory / MANIFEST).is_file() else sorted(directory.iterdir())
        return tuple(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in files
            if f.is_file() and (f.name == MANIFEST or f.name.endswith(_WEIGHT_SUFFIXES))
        )
    except OSError:
        return ()


def changed_source(recorded: WeightsSource, path: Optional[str | os.PathLike] = None) -> str:
    """Why the weights at ``path`` (default: the recorded path) are not ``recorded``'s: "" when they are the same,
    else a short reason ("... does not exist", "... changed since")."""
    where = path if path is not None else recorded.path
    try:
        if not _local(where).is_dir():
            return f"{where} does not exist"
    except FileNotFoundError:  # nothing at the URL
        return f"{where} does not exist"
    try:
        actual = weights_hash(where)
    except (OSError, ValueError) as error:
        return f"{where} cannot be read ({error})"
    if actual != recorded.sha256:
        return (
            f"the weights in {where} are not the ones recorded (sha256 {actual[:12]}, recorded {recorded.sha256[:12]})"
        )
    return ""
