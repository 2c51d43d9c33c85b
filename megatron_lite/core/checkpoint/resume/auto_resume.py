"""Which checkpoint a run resumes: the newest *valid* one in its checkpoint directories.

A run's checkpoint directory (ModelCheckpoint's ``dirpath``) holds several checkpoints -- top-k, every
n steps, ``last.ckpt`` -- and perhaps the hidden leftover of a save that was killed, or a checkpoint whose
bytes changed on storage. Resuming takes the newest finished checkpoint (by its commit time, the
manifest's ``written_at``) whose files all match their checksums; the others are skipped with the reason
(the caller warns), so a run neither fails on a bad newest checkpoint nor starts again from step 0 while a
good older one exists.

Two steps, because every rank of a job must choose the same checkpoint and the first step runs before
any process group exists:

- :func:`has_finished_checkpoint` looks at the file system only (manifests and file sizes, no
  checksums). Every rank reaches the same answer as long as nothing writes into the directories, and
  nothing does before the job's ranks have joined their process group (a restarted job's previous
  ranks are gone). It decides between resuming and starting fresh.
- :func:`newest_valid_checkpoint` is collective: rank 0 puts back a checkpoint whose replace was
  interrupted, removes the leftovers of killed saves and lists the finished checkpoints, newest first;
  the ranks then check them together (:func:`verify_checkpoint` shares the files out), and the first
  that passes is the choice on every rank.

A directory that is an object store's URL is surveyed by its commit markers instead
(:mod:`~megatron_lite.core.checkpoint.format.object_commit`): a checkpoint without one is never resumed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable, Optional

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format import object_commit
from megatron_lite.core.checkpoint.format.commit import clean_up, finished, siblings_in, written_at
from megatron_lite.core.checkpoint.format.integrity import MANIFEST, check_file, read_manifest, verify_checkpoint
from megatron_lite.core.checkpoint.format.rank_zero import on_rank0
from megatron_lite.core.object_store import Location, is_remote, location

# A directory holding any of these (or a *.distcp shard) is, or was meant to be, a checkpoint.
_CHECKPOINT_MARKS = (".metadata", "meta.json", MANIFEST, "meta.pt")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A checkpoint that was not resumed, and why."""

    path: str
    """The checkpoint directory (or the hidden directory of a save that never finished)."""
    reason: str
    """What is wrong with it, naming the bad files."""


@dataclasses.dataclass(frozen=True)
class ResumeChoice:
    """The outcome of :func:`newest_valid_checkpoint`."""

    checkpoint: Optional[Location]
    """The newest checkpoint whose files all passed their checks (in an object store: the prefix of its files); None
    when there is none."""
    verified: bool
    """False when the chosen checkpoint has no manifest (written before checksums): loaded unchecked."""
    skipped: list[Skipped]
    """Unfinished saves, then the newer checkpoints that failed their checks (newest first)."""


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _looks_like_checkpoint(path: Path) -> bool:
    if not path.is_dir() or path.is_symlink():
        return False
    # DCP writes the shards first and .metadata after them: a save killed mid-write has shards only
    return any(e.name in _CHECKPOINT_MARKS or e.name.endswith(".distcp") for e in _entries(path))


def finished_checkpoints(directories: Iterable[str | os.PathLike]) -> list[Location]:
    """The finished checkpoints directly inside ``directories`` (by manifest and sizes; in an object store, committed
    ones), newest first. Links (ModelCheckpoint's ``save_last="link"``) are left out: what they point to is listed
    itself."""
    found: dict[str, tuple[float, Location]] = {}
    for directory in directories:
        if is_remote(directory):
            for url, when in object_commit.committed(str(location(directory))):
                found.setdefault(url, (when, url))
            continue
        for path in _entries(Path(directory)):
            if not path.name.startswith(".") and not path.is_symlink() and path.is_dir() and finished(path):
                found.setdefault(str(path.resolve()), (written_at(path), path))
    return [p for _, p in sorted(found.values(), key=lambda item: (item[0], str(item[1])), reverse=True)]


def has_finished_checkpoint(directories: Iterable[str | os.PathLike]) -> bool:
    """Whether a finished checkpoint is in ``directories`` -- counting one left under a hidden name by a
    replace that was interrupted, which :func:`newest_valid_checkpoint` puts back first. File system only:
    no process group needed."""
    for directory in directories:
        if finished_checkpoints([directory]):
            return True
        if is_remote(directory):
            continue
        directory = Path(directory)
        for path, match in siblings_in(directory):
            if match["kind"] in ("tmp", "old") and not os.path.lexists(directory / match["name"]) and finished(path):
                return True
    return False


def _why_unfinished(path: Path) -> str:
    try:
        manifest = read_manifest(path)
    except CorruptCheckpointError as error:
        return str(error)
    if manifest is None:
        return f"no {MANIFEST}: the save did not finish"
    problems = [p for n, r in manifest.files.items() if (p := check_file(path, n, r, checksum=False)) is not None]
    return "; ".join(problems) or "incomplete"


def unfinished_checkpoints(directories: Iterable[str | os.PathLike]) -> list[Skipped]:
    """Checkpoints in ``directories`` that are not finished: visible ones with files missing or cut short,
    and the hidden directories of saves killed before they committed (which the next save removes)."""
    skipped = []
    for directory in directories:
        if is_remote(directory):
            skipped += [Skipped(url, why) for url, why in object_commit.uncommitted(str(location(directory)))]
            continue
        directory = Path(directory)
        for path in _entries(directory):
            if not path.name.startswith(".") and _looks_like_checkpoint(path) and not finished(path):
                skipped.append(Skipped(str(path), _why_unfinished(path)))
        for path, match in siblings_in(directory):
            restorable = match["kind"] in ("tmp", "old") and not os.path.lexists(directory / match["name"])
            if match["kind"] == "tmp" and not (restorable and finished(path)) and _looks_like_checkpoint(path):
                skipped.append(
                    Skipped(
                        str(path),
                        f"a save of {match['name']} that was killed before it was committed ({_why_unfinished(path)})",
                    )
                )
    return skipped


def _survey(directories: list[str]) -> tuple[list[str], list[Skipped]]:
    skipped = unfinished_checkpoints(directories)  # before the clean-up removes the leftovers it names
    for directory in directories:
        if is_remote(directory):
            object_commit.clean_up(str(location(directory)))
        elif os.path.isdir(directory):
            clean_up(directory)
    # what is loaded: a directory on disk, the prefix its commit marker names in an object store
    found = [p if isinstance(p, Path) else object_commit.data_of(p) for p in finished_checkpoints(directories)]
    return [str(p) for p in found if p is not None], skipped


def newest_valid_checkpoint(directories: Iterable[str | os.PathLike]) -> ResumeChoice:
    """The newest finished checkpoint in ``directories`` whose files all match their checksums, and what was
    skipped on the way; collective when a process group exists (every rank gets the same choice)."""
    candidates, skipped = on_rank0(lambda: _survey([str(d) for d in directories]))
    for candidate in candidates:
        try:
            verdict = verify_checkpoint(candidate)
        except CorruptCheckpointError as error:
            reason = "; ".join(error.problems) if error.problems else str(error)
            skipped.append(Skipped(candidate, reason))
            continue
        return ResumeChoice(location(candidate), verdict.status == "ok", skipped)
    return ResumeChoice(None, False, skipped)
