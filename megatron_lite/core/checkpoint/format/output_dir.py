"""Where a writer (``megatron-lite convert``, ``quantize``, ``prune``) may put its output, and what its
``--overwrite`` may replace.

- The output is never an input, inside one, or a directory that holds one (symbolic links resolved): writing
  there would clobber what is being read, and replacing it would delete it (``--output runs`` next to
  ``--input runs/last.ckpt`` once wiped every checkpoint in ``runs/``).
- An existing non-empty output is replaced only with ``overwrite`` and only when it is an earlier output of
  megatron-lite with nothing else in it: a checkpoint whose ``manifest.json`` lists every file in it, or a
  directory a writer marked with :data:`OUTPUT_MARKER` (an HF export), which lists the files it wrote. Anything
  else -- a directory of checkpoints, a user's folder, an output someone added files to -- is refused with a
  message and never deleted. A missing path or an empty directory is always fine.
- An output at a URL (``s3://bucket/out``) is checked the same way against the objects under that prefix: none is
  fine; else only ``overwrite`` of an earlier output of megatron-lite with nothing else there -- one of our
  checkpoints (its commit marker and the ``v-*`` prefix it names) or an HF export's objects listed by its
  :data:`OUTPUT_MARKER`. The writer then replaces it (a checkpoint's commit, or
  :func:`~megatron_lite.core.object_staging.published_directory` with ``replace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format import object_commit
from megatron_lite.core.checkpoint.format.integrity import MANIFEST, read_manifest
from megatron_lite.core.object_staging import objects_under, published_directory
from megatron_lite.core.object_store import is_remote, join, read_bytes

OUTPUT_MARKER = "megatron_lite_output.json"
"""The file a writer leaves in an output directory that no manifest describes (an HF export): what wrote it
and the files it wrote, so that a later ``--overwrite`` knows the directory is ours to replace."""
MARKER_FORMAT = "megatron-lite-output/1"


def _files_under(directory: Path) -> list[str]:
    """Every entry under ``directory`` that is not a directory, as a relative POSIX path (links included)."""
    found = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        found += [(here / name).relative_to(directory).as_posix() for name in files]
        found += [(here / name).relative_to(directory).as_posix() for name in dirs if (here / name).is_symlink()]
    return sorted(found)


def _written_by_us(directory: Path) -> tuple[Optional[set[str]], str]:
    """(the files an earlier megatron-lite output in ``directory`` consists of, or None; why not)."""
    try:
        manifest = read_manifest(directory)
    except CorruptCheckpointError:
        return None, f"its {MANIFEST} is damaged"
    if manifest is not None:
        return {*manifest.files, MANIFEST}, ""
    marker = directory / OUTPUT_MARKER
    if marker.is_file():
        listed = _listed_files(marker.read_bytes())
        return (listed, "") if listed is not None else (None, f"its {OUTPUT_MARKER} is damaged")
    return None, f"it has no {MANIFEST} or {OUTPUT_MARKER}"


def _listed_files(marker: bytes) -> Optional[set[str]]:
    """The files an :data:`OUTPUT_MARKER` (its content) says its output consists of, itself included; None when it
    is damaged."""
    try:
        document = json.loads(marker.decode("utf-8"))
        if document.get("format") != MARKER_FORMAT or not isinstance(document.get("files"), list):
            return None
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return {*map(str, document["files"]), OUTPUT_MARKER}


def check_output(
    output: str | os.PathLike,
    inputs: Iterable[Optional[str | os.PathLike]] = (),
    overwrite: bool = False,
    option: str = "--output",
) -> None:
    """Refuse ``output`` (ValueError, FileExistsError: one line naming the fix) unless a writer may write it:
    not one of ``inputs``, inside one or holding one; absent, an empty directory, or -- with ``overwrite`` --
    an earlier megatron-lite output with nothing else in it (see the module docstring). Call it before any
    weights are read."""
    if is_remote(output):
        _check_object_output(os.fspath(output).rstrip("/"), inputs, overwrite, option)
        return
    path = Path(output)
    target = path.resolve()
    for given in inputs:
        if given is None or not os.path.lexists(given):
            continue
        source = Path(given).resolve()
        if target == source:
            raise ValueError(f"{option} {output} is the input {given}; write to a new directory")
        if source in target.parents:
            raise ValueError(f"{option} {output} is inside the input {given}; write to a directory outside it")
        if target in source.parents:
            raise ValueError(
                f"{option} {output} holds the input {given} (replacing it would delete the input); "
                f"write to a new directory"
            )
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        raise FileExistsError(f"{option} {output} is a symbolic link; pass a new directory (or the real one)")
    if not path.is_dir():
        raise FileExistsError(f"{option} {output} is an existing file; pass a new directory")
    if not any(path.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"{option} {output} exists and is not empty; pass a new directory, or --overwrite to "
            f"replace an earlier output of megatron-lite"
        )
    ours, why = _written_by_us(path)
    if ours is None:
        raise FileExistsError(
            f"{option} {output} is not an output of megatron-lite ({why}), so --overwrite does "
            f"not replace it; pass a new directory, or remove it yourself"
        )
    foreign = [name for name in _files_under(path) if name not in ours]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise FileExistsError(
            f"{option} {output} holds {foreign[0]}{more}, which megatron-lite did not write, so "
            f"--overwrite does not replace it; pass a new directory, or move those files out"
        )


def _check_object_output(
    output: str, inputs: Iterable[Optional[str | os.PathLike]], overwrite: bool, option: str
) -> None:
    """:func:`check_output` for the prefix ``output`` in an object store."""
    for given in inputs:
        if given is None or not is_remote(given):
            continue
        source = os.fspath(given).rstrip("/")
        if output == source:
            raise ValueError(f"{option} {output} is the input {given}; write to a new prefix")
        if output.startswith(source + "/"):
            raise ValueError(f"{option} {output} is inside the input {given}; write to a prefix outside it")
        if source.startswith(output + "/"):
            raise ValueError(
                f"{option} {output} holds the input {given} (replacing it would delete the input); write to a new "
                f"prefix"
            )
    names = sorted(objects_under(output))
    if not names:
        return
    if not overwrite:
        raise FileExistsError(
            f"{option} {output} holds objects already; pass a new prefix, or --overwrite to replace an earlier "
            f"output of megatron-lite"
        )
    ours, why = _objects_written_by_us(output, names)
    if ours is None:
        raise FileExistsError(
            f"{option} {output} is not an output of megatron-lite ({why}), so --overwrite does not replace it; pass "
            f"a new prefix, or remove its objects yourself"
        )
    foreign = [name for name in names if not ours(name)]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise FileExistsError(
            f"{option} {output} holds {foreign[0]}{more}, which megatron-lite did not write, so --overwrite does "
            f"not replace it; pass a new prefix, or move those objects out"
        )


def _objects_written_by_us(output: str, names: list[str]) -> tuple[Optional[Callable[[str], bool]], str]:
    """(whether a name under ``output`` belongs to an earlier megatron-lite output there, or None; why not)."""
    try:
        marker = object_commit.read_marker(output)
    except CorruptCheckpointError:
        return None, f"its {object_commit.MARKER} is damaged"
    if marker is not None:  # one of our checkpoints: its marker and its saves' prefixes (a killed one's included)
        return lambda name: name == object_commit.MARKER or object_commit.is_version(name.split("/", 1)[0]), ""
    if OUTPUT_MARKER not in names:
        return None, f"it has no {object_commit.MARKER} or {OUTPUT_MARKER}"
    listed = _listed_files(read_bytes(str(join(output, OUTPUT_MARKER))))
    return (listed.__contains__, "") if listed is not None else (None, f"its {OUTPUT_MARKER} is damaged")


def mark_output(directory: str | os.PathLike, written_by: str) -> None:
    """Record in ``directory`` (just written by ``written_by``) that it is a megatron-lite output, listing its
    files, so that a later ``--overwrite`` may replace it. For outputs without a manifest (HF exports)."""
    directory = Path(directory)
    document = {
        "format": MARKER_FORMAT,
        "written_by": written_by,
        "written_at": time.time(),
        "files": [name for name in _files_under(directory) if name != OUTPUT_MARKER],
    }
    tmp = directory / f".{OUTPUT_MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, directory / OUTPUT_MARKER)


@contextlib.contextmanager
def output_directory(output: str | os.PathLike, overwrite: bool, last: Sequence[str]) -> Iterator[Path]:
    """Where a writer of a directory (an HF export) puts ``output``, checked by :func:`check_output` first: the path
    itself; for a URL, a local folder uploaded there when the block ends without an error, ``last`` (the file whose
    presence says the directory is complete: an HF ``config.json``) after all others, the objects of the earlier
    output that ``overwrite`` replaces deleted before (:func:`~megatron_lite.core.object_staging.published_directory`).
    """
    if not is_remote(output):
        yield Path(output)
        return
    with published_directory(os.fspath(output), last=last, replace=overwrite) as folder:
        yield Path(folder)
