"""The atomic commit of a checkpoint in an object store (``s3://bucket/run/step=4``), where nothing can be renamed.

A store has no rename and no exchange, but one PUT is atomic: a reader sees the whole object or none. So a
checkpoint at the URL ``<name>`` is a prefix holding::

    <name>/v-<8 hex digits>/   the save's files (DCP's shards and .metadata, meta.json, manifest.json)
    <name>/commit.json         the commit marker, written last: {"format": ..., "data": "v-...", "written_at": ...}

A save writes every file under a fresh ``v-*`` prefix (the temporary prefix), the manifest last among them, and
then the marker naming it; only then is the previous ``v-*`` of ``<name>`` (a re-saved ``last.ckpt``) deleted.
Loading ``<name>`` reads the marker and then the prefix it names, so a kill at any instant leaves the previous
checkpoint (or none) under ``<name>``, never half of one. A checkpoint without its marker -- a save killed before
it committed, or a removal killed after deleting it (a removal deletes the marker first) -- is never loaded: an
explicit load is refused naming it, ``ckpt_path="last"`` skips it, and the next save into the same directory
deletes it (:func:`clean_up`), together with ``v-*`` prefixes no marker names.

``latest_checkpoint.json`` in the directory records the newest committed checkpoint, as on disk (one PUT).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Collection, Optional

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format.commit import LATEST, latest_bytes, log_removed, parse_latest
from megatron_lite.core.checkpoint.format.integrity import MANIFEST, check_file, read_manifest
from megatron_lite.core.object_staging import objects_under
from megatron_lite.core.object_store import errors_named, filesystem, join, name_of, parent_of, read_bytes, write_bytes

log = logging.getLogger(__name__)

MARKER = "commit.json"
MARKER_FORMAT = "megatron-lite-commit/1"
_VERSION = re.compile(r"^v-[0-9a-f]{8}$")


def is_version(name: str) -> bool:
    """Whether ``name`` is that of a save's prefix (``v-1f3a9c2e``)."""
    return bool(_VERSION.match(name))


def _listing(url: str) -> list[tuple[str, str]]:
    """(name, type) of the entries directly under the prefix ``url`` (fresh: other ranks and runs write there)."""
    fs = filesystem(url)
    with errors_named(url):
        fs.invalidate_cache(url)
        try:
            entries = fs.ls(url, detail=True, refresh=True)
        except FileNotFoundError:
            return []
    return [(name_of(entry["name"]), entry["type"]) for entry in entries]


def _remove_prefix(url: str) -> None:
    fs = filesystem(url)
    with errors_named(url):
        fs.invalidate_cache(url)
        if fs.exists(url):
            fs.rm(url, recursive=True)


def read_marker(checkpoint: str) -> Optional[dict[str, Any]]:
    """The commit marker of the checkpoint at ``checkpoint``, checked; None when there is none."""
    url = join(checkpoint, MARKER)
    assert isinstance(url, str)
    filesystem(url).invalidate_cache(checkpoint)
    try:
        raw = read_bytes(url)
    except FileNotFoundError:
        return None
    try:
        document = json.loads(raw.decode("utf-8"))
        if document.get("format") != MARKER_FORMAT or not _VERSION.match(str(document.get("data"))):
            raise ValueError(f"format {document.get('format')!r}, data {document.get('data')!r}")
        return document
    except (ValueError, UnicodeDecodeError, AttributeError) as error:
        raise CorruptCheckpointError(f"{url} is damaged ({error}); the checkpoint cannot be loaded") from None


def data_of(checkpoint: str) -> Optional[str]:
    """The prefix holding the files of the committed checkpoint ``checkpoint``; None without a marker."""
    marker = read_marker(checkpoint)
    return None if marker is None else str(join(checkpoint, marker["data"]))


# --- saving --------------------------------------------------------------------------------
def begin(checkpoint: str, in_flight: Collection[str] = ()) -> str:
    """Rank 0, before a save of ``checkpoint``: clean up its directory (not the ``in_flight`` saves' prefixes) and
    return the fresh prefix the save writes into."""
    clean_up(str(parent_of(checkpoint)), in_flight)
    return str(join(checkpoint, f"v-{uuid.uuid4().hex[:8]}"))


def commit(checkpoint: str, data: str, global_step: Optional[int], latest: bool) -> None:
    """Rank 0, once every file and the manifest are under ``data``: write the marker (the commit), delete the
    checkpoint's previous files, and with ``latest`` record it as its directory's latest."""
    names = set(objects_under(data))  # nested ones too: the files a checkpoint carries (tokenizer/, hf/)
    manifest = read_manifest(data)
    missing = sorted(set(manifest.files) - names) if manifest is not None else [MANIFEST]
    if missing:
        raise RuntimeError(f"checkpoint files {missing} were recorded but are not in {data}; nothing was committed")
    document = {"format": MARKER_FORMAT, "data": name_of(data), "global_step": global_step, "written_at": time.time()}
    write_bytes(str(join(checkpoint, MARKER)), json.dumps(document, indent=1).encode("utf-8"))
    for name, kind in _listing(checkpoint):
        if kind == "directory" and _VERSION.match(name) and name != name_of(data):
            _remove_prefix(str(join(checkpoint, name)))
    if latest:
        write_bytes(str(join(parent_of(checkpoint), LATEST)), latest_bytes(name_of(checkpoint), global_step))


def remove(checkpoint: str) -> None:
    """Remove a checkpoint: its marker first (it is no longer one at once), then its files."""
    fs, marker = filesystem(checkpoint), str(join(checkpoint, MARKER))
    with errors_named(checkpoint):
        if fs.exists(marker):
            fs.rm_file(marker)
    _remove_prefix(checkpoint)


# --- finding ---------------------------------------------------------------------------------
def _is_uncommitted(checkpoint: str, entries: list[tuple[str, str]]) -> bool:
    """A prefix that only a save wrote (``v-*`` prefixes) but whose marker is missing."""
    return bool(entries) and all(kind == "directory" and _VERSION.match(name) for name, kind in entries)


def resolve(path: str) -> str:
    """The prefix of the files to load for ``path``: the committed checkpoint ``path``, or the latest one in the
    directory of checkpoints ``path``; one clear ``FileNotFoundError`` otherwise (a checkpoint without its
    marker is refused, never loaded)."""
    data = data_of(path)
    if data is not None:
        return data
    entries = _listing(path)
    if _VERSION.match(name_of(path)) and (".metadata", "file") in entries:
        return path  # the files of a checkpoint (what resolving its name gave)
    if _is_uncommitted(path, entries):
        raise FileNotFoundError(
            f"{path} has no commit marker ({MARKER}): its save was interrupted before it committed, so it is not a "
            f"checkpoint and is never loaded (the next save into {parent_of(path)} deletes it). Load an earlier "
            f"checkpoint, or pass ckpt_path='last' to resume the newest complete one."
        )
    newest = latest_in(path)
    if newest is not None:
        log.info("megatron-lite: %s holds checkpoints; loading the latest one, %s", path, name_of(newest))
        return str(data_of(newest))
    if not entries:
        raise FileNotFoundError(f"no checkpoint at {path} (nothing is stored under that prefix)")
    raise FileNotFoundError(
        f"{path} is not a megatron-lite checkpoint (no {MARKER}); pass the URL that trainer.save_checkpoint() or "
        f"ModelCheckpoint wrote"
    )


def committed(directory: str) -> list[tuple[str, float]]:
    """The committed checkpoints directly under ``directory`` whose files are all there (by manifest and sizes,
    no checksums), with their commit times."""
    found = []
    for name, kind in _listing(directory):
        if kind != "directory" or name.startswith("."):
            continue
        checkpoint = str(join(directory, name))
        try:
            marker = read_marker(checkpoint)
        except CorruptCheckpointError:
            continue
        if marker is not None and _why_incomplete(str(join(checkpoint, marker["data"]))) is None:
            found.append((checkpoint, float(marker.get("written_at", 0.0))))
    return found


def latest_in(directory: str) -> Optional[str]:
    """The checkpoint ``latest_checkpoint.json`` in ``directory`` names when it is committed, else the committed
    one with the newest marker; None when there is none."""
    record = str(join(directory, LATEST))
    try:
        name: Optional[str] = parse_latest(read_bytes(record), record, directory)
    except FileNotFoundError:
        name = None
    if name is not None and read_marker(str(join(directory, name))) is not None:
        return str(join(directory, name))
    found = committed(directory)
    return max(found, key=lambda item: item[1])[0] if found else None


def _why_incomplete(data: str) -> Optional[str]:
    try:
        manifest = read_manifest(data)
    except CorruptCheckpointError as error:
        return str(error)
    if manifest is None:
        return f"no {MANIFEST}"
    problems = [p for n, r in manifest.files.items() if (p := check_file(data, n, r, checksum=False)) is not None]
    return "; ".join(problems) or None


def uncommitted(directory: str) -> list[tuple[str, str]]:
    """(checkpoint, why) of what is under ``directory`` but not resumable: prefixes without a commit marker (a
    save killed before it committed) and committed checkpoints whose files are missing or cut short."""
    found = []
    for name, kind in _listing(directory):
        if kind != "directory" or name.startswith("."):
            continue
        checkpoint = str(join(directory, name))
        try:
            marker = read_marker(checkpoint)
        except CorruptCheckpointError as error:
            found.append((checkpoint, str(error)))
            continue
        if marker is None:
            if _is_uncommitted(checkpoint, _listing(checkpoint)):
                found.append((checkpoint, f"no commit marker ({MARKER}): the save was killed before it committed"))
            continue
        why = _why_incomplete(str(join(checkpoint, marker["data"])))
        if why is not None:
            found.append((checkpoint, why))
    return found


def clean_up(directory: str, in_flight: Collection[str] = ()) -> list[str]:
    """Delete what killed saves left under ``directory``: checkpoints without a marker, and ``v-*`` prefixes their
    marker does not name (but not the ``in_flight`` saves' prefixes). Returns what was deleted; never raises (a
    clean-up that fails is logged)."""
    keep = {str(p).rstrip("/") for p in in_flight}
    removed = []
    try:
        for name, kind in _listing(directory):
            if kind != "directory" or name.startswith("."):
                continue
            checkpoint = str(join(directory, name))
            entries = _listing(checkpoint)
            try:
                marker = read_marker(checkpoint)
            except CorruptCheckpointError:
                continue  # never delete what cannot be understood
            if marker is None and not _is_uncommitted(checkpoint, entries):
                continue  # not a checkpoint of ours
            for version, version_kind in entries:
                prefix = str(join(checkpoint, version))
                named = marker is not None and version == marker["data"]
                if version_kind == "directory" and _VERSION.match(version) and not named and prefix not in keep:
                    _remove_prefix(prefix)
                    removed.append(prefix)
    except OSError as error:
        log.warning("megatron-lite: could not clean up interrupted saves in %s: %s", directory, error)
    log_removed(directory, removed)
    return removed
