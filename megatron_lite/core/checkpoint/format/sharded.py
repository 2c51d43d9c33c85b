"""One checkpoint written and read through torch.distributed.checkpoint, safely.

:func:`save_sharded` / :func:`load_sharded` put the pieces of the on-disk format together (see
``docs/checkpoint-format.md``): the non-tensor part as JSON (``meta_json``), checksums recorded while
writing and checked before reading (``integrity``), the atomic commit and recovery (``commit``), and
DCP reads that never unpickle (``safe_reader``). The state dicts they write are built from a live run by
:mod:`megatron_lite.core.checkpoint.state`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.core.checkpoint.errors import CheckpointMetaError, CorruptCheckpointError, UnsafeCheckpointError
from megatron_lite.core.checkpoint.format import meta_json, object_commit
from megatron_lite.core.checkpoint.format.commit import (
    clean_up,
    commit,
    fsync_dir,
    incomplete_leftovers,
    latest_in,
    record_latest,
    recover,
    sibling,
    write_file_durably,
)
from megatron_lite.core.checkpoint.format.commit import (
    remove_checkpoint as remove_local_checkpoint,
)
from megatron_lite.core.checkpoint.format.disk_space import disk_full_cause, disk_full_error, tensor_bytes
from megatron_lite.core.checkpoint.format.integrity import (
    LEGACY_META,
    MANIFEST,
    META,
    FileRecord,
    checksumming_writer,
    manifest_bytes,
    record_bytes,
    verify_checkpoint,
)
from megatron_lite.core.checkpoint.format.rank_zero import gather_to_all, on_rank0
from megatron_lite.core.checkpoint.format.safe_reader import SafeLoadPlanner, read_dcp_metadata, safe_reader
from megatron_lite.core.object_store import Location, is_remote, join, location, read_bytes, write_bytes

log = logging.getLogger(__name__)

EMBEDDED_FILES = "megatron_lite_embedded_files"
"""Key of a save's ``extra`` naming files to copy into the checkpoint, ``{path inside it: source file}`` (e.g.
``{"tokenizer/tokenizer.model": "/home/me/.cache/.../tokenizer.model"}``), so that it carries them with it: copied
when the save begins, checksummed in the manifest like its other files, never stored in ``meta.json``. Each
path is ``<folder>/<file>``: a folder of its own, so it never collides with the checkpoint's own files."""


def resolve_checkpoint(path: str | os.PathLike) -> Location:
    """The checkpoint directory to load for ``path`` (collective when a process group exists).

    ``path`` itself if it is a checkpoint; the one named by ``latest_checkpoint.json`` if ``path`` is a
    directory of checkpoints; if ``path`` is missing because a save was killed while replacing it, the
    complete sibling left behind is put back first (logged). Anything else raises one clear error, on
    every rank. For a URL: the prefix of the files its commit marker names
    (:mod:`~megatron_lite.core.checkpoint.format.object_commit`).
    """
    if is_remote(path):
        return on_rank0(lambda: object_commit.resolve(str(location(path))))
    return Path(on_rank0(lambda: str(_resolve(Path(path)))))


def _resolve(path: Path) -> Path:
    if not os.path.lexists(path):
        recover(path)
    if path.is_dir() and not (path / ".metadata").is_file():
        latest = latest_in(path)
        if latest is not None:
            log.info("megatron-lite: %s holds checkpoints; loading the latest one, %s", path, latest.name)
            return latest
    if (path / ".metadata").is_file():
        return path
    if not os.path.lexists(path):
        leftovers = incomplete_leftovers(path)
        hint = (
            f" Only the unfinished save(s) {', '.join(p.name for p in leftovers)} are there: the save was killed "
            f"before it finished, so load an earlier checkpoint."
            if leftovers
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {path}.{hint}")
    what = "a file" if path.is_file() else "a directory without DCP .metadata"
    raise FileNotFoundError(
        f"{path} is {what}, not a megatron-lite checkpoint; pass the directory that trainer.save_checkpoint() or "
        f"ModelCheckpoint wrote (it holds .metadata, *.distcp, meta.json and manifest.json)."
    )


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove the checkpoint at ``path`` so that a kill mid-removal never leaves half of one under its name: on disk
    renamed away first (:func:`~megatron_lite.core.checkpoint.format.commit.remove_checkpoint`), in an object store
    its commit marker deleted first (:func:`~megatron_lite.core.checkpoint.format.object_commit.remove`)."""
    if is_remote(path):
        object_commit.remove(str(location(path)))
    else:
        remove_local_checkpoint(path)


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """Flattened keys stored in a DCP checkpoint (to load only what it has)."""
    return set(read_dcp_metadata(join(location(path), ".metadata")).state_dict_metadata.keys())


def save_sharded(
    state: dict[str, Any],
    path: str | os.PathLike,
    extra: Optional[dict] = None,
    allowed: Sequence[type] = (),
    in_flight: Sequence[str | os.PathLike] = (),
    latest: bool = False,
) -> Location:
    """Write ``state`` with DCP and ``extra`` (the non-tensor part: loops, schedulers, hyperparameters) as
    ``meta.json`` under ``path``, atomically; collective when a process group exists.

    ``extra`` may hold what :mod:`megatron_lite.core.checkpoint.format.meta_json` encodes, with ``allowed`` as the
    config dataclasses besides the default ones; anything else is refused before a byte is written.
    ``extra[EMBEDDED_FILES]`` names files the checkpoint carries in folders of its own (:data:`EMBEDDED_FILES`). Rank 0
    first recovers or removes leftovers of killed saves next to ``path`` (but not ``in_flight`` ones), then
    every rank writes into a hidden temporary sibling, recording each file's size and CRC-32 as it writes;
    rank 0 writes ``meta.json`` and, last, ``manifest.json``, fsyncs, moves the directory into place (an
    atomic exchange when ``path`` exists, see :mod:`~megatron_lite.core.checkpoint.format.commit`) and, with
    ``latest`` (a training run's save), records it in ``latest_checkpoint.json``, which loading the directory
    follows -- so a writer's output (``megatron-lite prune --output runs/pruned``) never becomes what a load of
    ``runs`` picks. A kill at any point leaves the previous checkpoint at ``path``; a full
    disk raises :class:`~megatron_lite.core.checkpoint.errors.CheckpointDiskFullError` on every rank
    (the bytes needed and free), the unfinished save removed and the previous checkpoint left as it was.
    The steps are :func:`begin_save`, the DCP write, :func:`finish_save` (an asynchronous writer runs the
    last two in the background, see :mod:`~megatron_lite.core.checkpoint.format.async_save`).
    """
    target = begin_save(path, extra, allowed, in_flight, latest)
    writer = checksumming_writer(target.tmp)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as error:
        # DCP raised the same failures on every rank: a full disk is found (and reported) by all of them.
        full = disk_full_cause(error)
        if full is not None and isinstance(target.path, Path) and isinstance(target.tmp, Path):
            raise disk_full_error(target.path, target.tmp, full, tensor_bytes(state)) from None
        raise dcp_error(error, f"writing {target.path}") from None
    finish_save(target, writer.records)
    return target.path


@dataclasses.dataclass(frozen=True)
class SaveTarget:
    """A save under way: where its files go and what rank 0 writes beside them when they are all there."""

    path: Location
    """The checkpoint's final name."""
    tmp: Location
    """The hidden temporary sibling the files are written into (in an object store: the prefix under it)."""
    meta: Optional[bytes]
    """``meta.json``'s content on rank 0 (None on the other ranks)."""
    latest: bool
    """Whether the commit records it in ``latest_checkpoint.json`` (a training run's save)."""
    step: Optional[int]
    """The global step recorded there."""
    embedded: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    """The :data:`EMBEDDED_FILES` copied into :attr:`tmp` (rank 0), for the manifest."""


def begin_save(
    path: str | os.PathLike,
    extra: Optional[dict] = None,
    allowed: Sequence[type] = (),
    in_flight: Sequence[str | os.PathLike] = (),
    latest: bool = False,
) -> SaveTarget:
    """Encode ``extra`` (refused before a byte is written), clean up leftovers and create the temporary
    directory (rank 0); collective. ``latest``: record the checkpoint as its directory's latest once committed."""
    path = location(path)
    extra = dict(extra) if extra is not None else {}
    files = _embedded_names(extra.pop(EMBEDDED_FILES, None))
    meta = on_rank0(lambda: meta_json.dumps(extra, allowed), share=False)
    tmp, embedded = on_rank0(lambda: _begin_save(path, in_flight, files))
    step = extra.get("global_step")
    return SaveTarget(path, location(tmp), meta, latest, step if isinstance(step, int) else None, embedded)


def finish_save(target: SaveTarget, records: dict[str, FileRecord], group=None) -> None:
    """After every rank's DCP write returned: gather the ranks' file records, and rank 0 writes the
    manifest, commits and (:attr:`SaveTarget.latest`) records the latest; collective (over ``group`` when given)."""
    merged: dict[str, FileRecord] = dict(target.embedded)
    for rank_records in gather_to_all(records, group):
        merged.update(rank_records)
    on_rank0(lambda: _finish_save(target, merged), group=group)


def _embedded_names(files: Any) -> dict[str, str]:
    """The :data:`EMBEDDED_FILES` entry checked: ``<folder>/<file>`` names (no ``..``, no hidden parts)."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise TypeError(f"{EMBEDDED_FILES} must map paths inside the checkpoint to source files, got {files!r}")
    for name, source in files.items():
        parts = str(name).split("/")
        if not isinstance(name, str) or len(parts) < 2 or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"{EMBEDDED_FILES}: {name!r} is not a '<folder>/<file>' path inside the checkpoint")
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"{EMBEDDED_FILES}: the source of {name!r} must be a path, got {source!r}")
    return {name: os.fspath(source) for name, source in files.items()}


def _begin_save(
    path: Location, in_flight: Sequence[str | os.PathLike], files: dict[str, str]
) -> tuple[str, dict[str, FileRecord]]:
    missing = [source for source in files.values() if not os.path.isfile(source)]
    if missing:  # before a byte is written
        raise FileNotFoundError(f"{missing[0]}, a file the checkpoint {path} is to carry, does not exist")
    if isinstance(path, str):
        prefix = object_commit.begin(path, [str(p) for p in in_flight])
        uploaded = {}
        for name, source in files.items():
            content = Path(source).read_bytes()
            write_bytes(str(join(prefix, name)), content)
            uploaded[name] = record_bytes(content)
        return prefix, uploaded
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_up(path.parent, in_flight)
    tmp = sibling(path, "tmp")
    tmp.mkdir()
    records = {}
    for name, source in files.items():
        data = Path(source).read_bytes()
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        write_file_durably(tmp / name, data)
        records[name] = record_bytes(data)
    for folder in {(tmp / name).parent for name in files}:
        fsync_dir(folder)
    return str(tmp), records


def _finish_save(target: SaveTarget, records: dict[str, FileRecord]) -> None:
    tmp, meta = target.tmp, target.meta
    assert meta is not None  # rank 0 (this function's only caller) encoded it in begin_save
    if isinstance(tmp, str) or isinstance(target.path, str):
        write_bytes(str(join(tmp, META)), meta)
        write_bytes(str(join(tmp, MANIFEST)), manifest_bytes({**records, META: record_bytes(meta)}))
        object_commit.commit(str(target.path), str(tmp), target.step, target.latest)
        return
    write_file_durably(tmp / META, meta)
    records = {**records, META: record_bytes(meta)}
    missing = [n for n in records if not (tmp / n).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint files {missing} were recorded but not written into {tmp}")
    write_file_durably(tmp / MANIFEST, manifest_bytes(records))
    commit(tmp, target.path)
    if target.latest:
        record_latest(target.path, target.step)


def load_sharded(
    state: dict[str, Any], path: str | os.PathLike, allowed: Sequence[type] = (), verify: bool = True
) -> dict:
    """Load ``state`` in place from a checkpoint written by :func:`save_sharded`; returns ``extra``.

    The path is resolved (:func:`resolve_checkpoint`) and every file checked against the manifest first
    (``verify=False`` when the caller did both); DCP then reads through the allow-list reader and
    planner, so nothing in the checkpoint is unpickled. Collective when a process group exists.
    """
    path = resolve_checkpoint(path)
    if verify:
        verify_checkpoint(path)
    read_dcp_metadata(
        join(path, ".metadata")
    )  # a refusal raised here keeps its message (DCP would fold it into another)
    try:
        dcp.load(state, storage_reader=safe_reader(path), planner=SafeLoadPlanner())
    except CheckpointException as error:
        raise dcp_error(error, f"loading {path}") from None
    return read_checkpoint_meta(path, allowed)


def dcp_error(error: CheckpointException, doing: str) -> Exception:
    """DCP gathers every rank's failure into one CheckpointException (a BaseException, which Lightning's
    error handling does not expect): the failure itself, as the same error on every rank."""
    failures = sorted(error.failures.items(), key=lambda item: item[0])
    for _, (exc, _trace) in failures:
        if isinstance(exc, (UnsafeCheckpointError, CorruptCheckpointError, CheckpointMetaError)):
            return exc
    rank, (exc, _trace) = failures[0]
    return RuntimeError(f"torch.distributed.checkpoint failed {doing} on rank {rank}: {type(exc).__name__}: {exc}")


def read_checkpoint_meta(path: str | os.PathLike, allowed: Sequence[type] = ()) -> dict:
    """The non-tensor part of a checkpoint: ``meta.json`` (see :mod:`~megatron_lite.core.checkpoint.format.meta_json`;
    dataclasses rebuilt only from the default config classes and ``allowed``), or for checkpoints written
    before it, ``meta.pt`` read with ``weights_only=True`` and the same classes; ``{}`` if neither is there.
    Nothing in either file can run code on load."""
    if is_remote(path):
        meta = join(location(path), META)
        return meta_json.loads(read_bytes(meta), allowed, source=str(meta))
    path = Path(path)
    if (path / META).is_file():
        return meta_json.loads((path / META).read_bytes(), allowed, source=str(path / META))
    legacy = path / LEGACY_META
    if not legacy.is_file():
        return {}
    try:
        with torch.serialization.safe_globals([*meta_json.default_config_classes(), *allowed]):
            return torch.load(legacy, weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(legacy))
        raise ValueError(
            f"{legacy} holds objects of types outside what a checkpoint may contain ({', '.join(unsafe) or error}); "
            f"megatron-lite never unpickles arbitrary objects. Keep hyperparameters to configs, numbers and "
            f"strings (or only load checkpoints you wrote yourself after adding their classes with "
            f"torch.serialization.add_safe_globals)."
        ) from None
