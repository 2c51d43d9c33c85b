"""Putting a finished checkpoint in place so that a kill at any instant leaves a loadable one.

A save writes into a hidden sibling ``.<name>.tmp-<id>``; when every file is written and fsynced and the
manifest is written last, :func:`commit` moves it to ``<name>``:

- ``<name>`` absent: one ``rename``.
- ``<name>`` present (Lightning re-saving ``last.ckpt``): the two directories are exchanged in one atomic
  ``renameat2(RENAME_EXCHANGE)`` (Linux; ext4, xfs, btrfs, tmpfs), so ``<name>`` is the old checkpoint
  until the instant it is the new one, and the old one, now under the temporary name, is removed. Where
  the file system cannot exchange, the old checkpoint is renamed to ``.<name>.old-<id>`` and the new one
  to ``<name>``: between the two renames ``<name>`` is missing, and :func:`recover` puts the newest
  complete sibling back (loading such a path does it, with a logged note, and so does the next save and
  the launching process before ranks start).

Every removal deletes the manifest first, so a directory half removed by a kill is never taken for a
complete checkpoint. Leftovers of killed saves (``.<name>.tmp-*``, ``.old-*``, ``.del-*`` holding only
checkpoint files) are removed at the next save into the same directory; a complete one whose
``<name>`` is missing is recovered instead. One training job writes a checkpoint directory at a time
(as Lightning assumes); an in-flight save that must survive the clean-up (an asynchronous writer) is
passed as ``in_flight``.

After the commit, ``latest_checkpoint.json`` in the same directory records the checkpoint as the
latest one (a small JSON file replaced atomically); loading that directory loads it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Collection, Optional

from megatron_lite.core.checkpoint.format.integrity import LEGACY_META, MANIFEST, is_complete, read_manifest
from megatron_lite.core.checkpoint.format.safe_reader import read_dcp_metadata

log = logging.getLogger(__name__)

LATEST = "latest_checkpoint.json"
LATEST_FORMAT = "megatron-lite-latest/1"
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<id>[0-9a-f]{8})$")
# Every file a save writes (DCP's shards and metadata, their temporaries, ours; besides them only folders of
# plain files it carries, such as tokenizer/): a directory holding anything else is never removed by the
# clean-up, whatever its name.
_CHECKPOINT_FILE = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|meta\.json|meta\.pt|manifest\.json)$")


def sibling(path: Path, kind: str) -> Path:
    """A fresh hidden sibling name of ``path``: ``.<name>.<kind>-<8 hex digits>``."""
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}"


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the entries of ``directory`` (creations, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory entry is fsynced by the caller)."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b``; False where the platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False  # a C library without renameat2 (glibc < 2.28)
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def remove_tree(path: Path) -> None:
    """Remove a checkpoint directory (manifest first, so a half-removed one is never complete), or a
    file or symbolic link (never what a link points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def commit(tmp: Path, path: Path, use_exchange: bool = True) -> None:
    """Move the finished checkpoint ``tmp`` to ``path``, replacing what is there (see the module docstring).
    ``use_exchange=False`` takes the two-rename path that file systems without exchange take."""
    fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        fsync_dir(path.parent)
        return
    if use_exchange and _exchange(tmp, path):
        fsync_dir(path.parent)
        remove_tree(tmp)  # the previous checkpoint, now under the temporary name
        return
    old = sibling(path, "old")
    os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    remove_tree(old)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove the checkpoint at ``path``: first renamed away (it disappears from its name at once), then
    deleted. A symbolic link (Lightning's ``save_last="link"``) is unlinked, its target kept."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    trash = sibling(path, "del")
    os.rename(path, trash)
    fsync_dir(path.parent)
    remove_tree(trash)


# --- recovery and clean-up ------------------------------------------------------------------
def _legacy_complete(directory: Path) -> bool:
    """A checkpoint written before manifests existed (``meta.pt``): complete when its metadata reads and
    every data file it refers to is at least as long as the bytes it needs."""
    if not (directory / LEGACY_META).is_file():
        return False
    try:
        metadata = read_dcp_metadata(directory / ".metadata")
    except (OSError, ValueError):
        return False
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return all((directory / n).is_file() and (directory / n).stat().st_size >= end for n, end in needed.items())


def written_at(directory: Path) -> float:
    """When the checkpoint in ``directory`` was committed (its manifest's time; ``.metadata``'s mtime without one)."""
    try:
        manifest = read_manifest(directory)
    except ValueError:
        manifest = None
    return manifest.written_at if manifest is not None else (directory / ".metadata").stat().st_mtime


def finished(directory: Path) -> bool:
    """Whether ``directory`` (not a link) holds a finished save: complete by its manifest, or an older
    checkpoint without one whose files are all there."""
    return directory.is_dir() and not directory.is_symlink() and (is_complete(directory) or _legacy_complete(directory))


def siblings_in(parent: Path) -> list[tuple[Path, re.Match]]:
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return []
    return [(p, m) for p in entries if (m := _SIBLING.match(p.name))]


def recover(path: str | os.PathLike) -> Optional[Path]:
    """If ``path`` is missing and a save or swap into it was interrupted, put the newest complete
    ``.<name>.tmp-*`` / ``.old-*`` sibling back under ``path`` (logged). Returns the sibling it used."""
    path = Path(path)
    if os.path.lexists(path):
        return None
    candidates = [
        p for p, m in siblings_in(path.parent) if m["name"] == path.name and m["kind"] in ("tmp", "old") and finished(p)
    ]
    if not candidates:
        return None
    newest = max(candidates, key=written_at)
    os.rename(newest, path)
    fsync_dir(path.parent)
    log.warning(
        "megatron-lite: %s was missing (a save was interrupted while replacing it); recovered the complete "
        "checkpoint left at %s",
        path,
        newest.name,
    )
    return newest


def incomplete_leftovers(path: str | os.PathLike) -> list[Path]:
    """The siblings of ``path`` left by interrupted saves into it (for error messages)."""
    path = Path(path)
    return [p for p, m in siblings_in(path.parent) if m["name"] == path.name]


def _only_checkpoint_files(path: Path, kind: str) -> bool:
    if path.is_symlink():
        return True
    if path.is_file():  # a replaced or removed single-file checkpoint, or the latest record's temporary
        return kind in ("old", "del") or path.name.startswith(f".{LATEST}.")
    try:
        return all(_checkpoint_entry(e) for e in path.iterdir())
    except OSError:
        return False


def _checkpoint_entry(entry: Path) -> bool:
    """A file a save writes, or a folder of plain files a checkpoint carries (``tokenizer/``)."""
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return all(e.is_file() and not e.is_symlink() for e in entry.iterdir())
    return entry.is_file() and bool(_CHECKPOINT_FILE.match(entry.name))


def log_removed(directory: str | os.PathLike, names: list[str]) -> None:
    """Say which leftovers of interrupted saves a clean-up of ``directory`` removed (nothing when none)."""
    if names:
        log.info(
            "megatron-lite: removed %d leftover(s) of interrupted checkpoint saves in %s: %s",
            len(names),
            directory,
            ", ".join(names),
        )


def clean_up(directory: str | os.PathLike, in_flight: Collection[str | os.PathLike] = ()) -> list[Path]:
    """Recover interrupted swaps in ``directory`` and remove the leftovers of killed saves (see the module
    docstring); returns what was removed. Never raises: a clean-up that fails is logged."""
    directory = Path(directory)
    keep = {Path(p).resolve() for p in in_flight}
    removed = []
    try:
        siblings = [(p, m) for p, m in siblings_in(directory) if p.resolve() not in keep]
        for name in sorted({m["name"] for _, m in siblings}):
            recover(directory / name)
        for path, match in siblings_in(directory):
            if path.resolve() in keep or not _only_checkpoint_files(path, match["kind"]):
                continue
            remove_tree(path)
            removed.append(path)
    except OSError as error:
        log.warning("megatron-lite: could not clean up interrupted saves in %s: %s", directory, error)
    log_removed(directory, [p.name for p in removed])
    return removed


# --- latest ----------------------------------------------------------------------------------
def latest_bytes(name: str, global_step: Optional[int]) -> bytes:
    """The content of ``latest_checkpoint.json`` naming the checkpoint ``name`` of its directory."""
    document = {"format": LATEST_FORMAT, "name": name, "global_step": global_step, "written_at": time.time()}
    return json.dumps(document, indent=1).encode("utf-8")


def record_latest(path: Path, global_step: Optional[int]) -> None:
    """Record ``path`` as the latest checkpoint of its directory (``latest_checkpoint.json``, replaced atomically)."""
    record = path.parent / LATEST
    tmp = path.parent / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
    write_file_durably(tmp, latest_bytes(path.name, global_step))
    os.replace(tmp, record)
    fsync_dir(path.parent)


def read_latest(directory: str | os.PathLike) -> Optional[str]:
    """The name recorded in ``directory/latest_checkpoint.json``, or None if there is none."""
    record = Path(directory) / LATEST
    try:
        raw = record.read_bytes()
    except FileNotFoundError:
        return None
    return parse_latest(raw, str(record), str(directory))


def parse_latest(raw: bytes, record: str, directory: str) -> str:
    """The checkpoint name in the content ``raw`` of the record ``record`` of ``directory``, checked."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{record} is damaged ({error}); pass the checkpoint's own directory instead") from None
    name = document.get("name") if isinstance(document, dict) else None
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
        raise ValueError(f"{record} does not name a checkpoint in {directory}")
    return name


def latest_in(directory: str | os.PathLike) -> Optional[Path]:
    """The newest checkpoint in a directory of checkpoints: the one ``latest_checkpoint.json`` names (put
    back first if a replace of it was interrupted), else -- no record, or it names one that is gone -- the
    complete checkpoint with the newest manifest (logged). None when there is none."""
    directory = Path(directory)
    name = read_latest(directory)
    if name is not None:
        recover(directory / name)
        if (directory / name).is_dir():
            return directory / name
    complete = [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_dir() and is_complete(p)]
    if not complete:
        return None
    newest = max(complete, key=written_at)
    if name is not None:
        log.warning(
            "megatron-lite: %s names %s, which is gone; using the newest complete checkpoint there, %s",
            directory / LATEST,
            name,
            newest.name,
        )
    return newest
