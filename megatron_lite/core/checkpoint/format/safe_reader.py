"""Reading DCP checkpoints without unpickling arbitrary objects.

torch's ``FileSystemReader.read_metadata`` reads ``.metadata`` with a plain ``pickle.load``, and its
``DefaultLoadPlanner.load_bytes`` reads non-tensor entries with a full (code-running) ``torch.load``: a
downloaded checkpoint could run any code when opened. :class:`SafeFileSystemReader` unpickles
``.metadata`` with an allow-list (DCP's metadata dataclasses and the few torch types they hold, looked
up in a fixed table -- nothing named by the file is imported), and :class:`SafeLoadPlanner` reads the
non-tensor entries with ``weights_only=True``. Tensor data is already read by torch with
``weights_only=True``. Every DCP read in megatron-lite goes through both.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_lite.core.checkpoint.errors import UnsafeCheckpointError
from megatron_lite.core.object_store import Location, is_remote, location, open_read

_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout_by_name(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles): a table look-up."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


# (module, name) in the pickle -> the object it may stand for. Found by reading
# torch/distributed/checkpoint/metadata.py and by listing the globals of checkpoints we write
# (TP DTensor shards, plain and ZeRO-1 optimizer state, fp32 and bf16).
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout_by_name,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # StorageMeta.checkpoint_id; a pure path does no I/O
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): dict,
    **{("torch", str(v).removeprefix("torch.")): v for v in vars(torch).values() if isinstance(v, torch.dtype)},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise UnsafeCheckpointError(
                f"{self.source} refers to {module}.{name}, which a DCP checkpoint's metadata never holds; "
                f"megatron-lite does not unpickle it (a crafted checkpoint could run code that way). Only load "
                f"checkpoints written by torch.distributed.checkpoint."
            )
        return _ALLOWED[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source} holds a persistent id, which DCP metadata never holds")


def is_file_name(name: Any) -> bool:
    """Whether ``name`` (read from an index: DCP's storage entries, a manifest, an HF shard map) names a file
    directly inside the index's directory. A path with a separator, ``..`` or an absolute one could name any
    file on the machine; the formats we read only ever list plain file names. The name alone is judged, never
    where it leads (a Hugging Face cache's files are symlinks into its blob store)."""
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name


def is_inner_path(name: Any) -> bool:
    """Whether ``name`` is a relative ``/``-separated path that stays inside the directory it is read from
    (a manifest lists the files a checkpoint carries in folders of its own: ``tokenizer/tokenizer.model``)."""
    return isinstance(name, str) and not name.startswith("/") and all(is_file_name(part) for part in name.split("/"))


def read_dcp_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The DCP ``Metadata`` in the file (or object) ``path``, unpickled through the allow-list and checked."""
    source = str(path)
    try:
        with open_read(location(path)) as file:
            metadata = _MetadataUnpickler(file, source).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise
    except Exception as error:  # a truncated or garbled file: pickle raises many types
        raise UnsafeCheckpointError(
            f"{source} cannot be read as DCP metadata ({type(error).__name__}: {error}); the file is damaged"
        ) from None
    _check_metadata(metadata, source)
    return metadata


def _check_metadata(metadata: Any, source: str) -> None:
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{source} does not hold DCP metadata (found {type(metadata).__name__})")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)):
            raise UnsafeCheckpointError(f"{source}: entry {key!r} is a {type(entry).__name__}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{source} has no storage index")
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise UnsafeCheckpointError(f"{source}: the storage entry of {index} is a {type(info).__name__}")
        # DCP writes flat files: a path that leaves the checkpoint directory is crafted
        if not is_file_name(info.relative_path):
            raise UnsafeCheckpointError(
                f"{source}: storage file {info.relative_path!r} is not a file name inside the checkpoint directory"
            )


def storage_files(metadata: dcp_metadata.Metadata) -> set[str]:
    """The data files (``__<rank>_<n>.distcp``) that a checkpoint's metadata refers to."""
    return {info.relative_path for info in metadata.storage_data.values()}


def _why(error: Exception) -> str:
    """What went wrong reading an entry, in words that never pass on torch's advice to retry with
    ``weights_only`` off (what its weights-only unpickler says about a file it refuses)."""
    if isinstance(error, pickle.UnpicklingError):
        return "its bytes are not a plain torch.save'd tensor"
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    if not text or "weights_only" in text:
        return type(error).__name__
    return f"{type(error).__name__}: {text}"


class _SafeReading:
    """Mixed into one of DCP's readers: ``.metadata`` is read through the allow-list unpickler, and a failure to
    read an entry is one :class:`UnsafeCheckpointError` naming the file and the entry."""

    path: Any
    storage_data: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))  # type: ignore[attr-defined]
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # One entry at a time (torch's reader reads them synchronously too), so a failure knows its entry.
        for item in plan.items:
            file = f"{str(self.path).rstrip('/')}/{self.storage_data[item.storage_index].relative_path}"
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner)  # type: ignore[misc]
            except UnsafeCheckpointError as error:
                raise UnsafeCheckpointError(f"{file}: {error}") from None
            except Exception as error:  # a crafted or garbled entry: torch.load raises many types
                raise UnsafeCheckpointError(
                    f"{file}: checkpoint entry {item.dest_index.fqn!r} cannot be read ({_why(error)}); the checkpoint "
                    f"is malformed (damaged, or not written by torch.distributed.checkpoint) and cannot be loaded"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """DCP's reader of a local checkpoint directory, reading safely (see :class:`_SafeReading`)."""


class SafeFsspecReader(_SafeReading, FsspecReader):
    """DCP's reader of a checkpoint in an object store (a URL prefix), reading safely (see :class:`_SafeReading`)."""


def safe_reader(path: Location) -> SafeFileSystemReader | SafeFsspecReader:
    """The safe DCP reader of the checkpoint at ``path`` (a local directory or a URL)."""
    if isinstance(path, str) and is_remote(path):
        return SafeFsspecReader(path)
    return SafeFileSystemReader(str(path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            value.seek(0)
            try:
                unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(value))
            except Exception:  # noqa: BLE001 - not even a torch.save archive
                unsafe = ""
            raise UnsafeCheckpointError(
                f"checkpoint entry {fqn!r} holds objects outside plain data ({unsafe or 'not a torch.save archive'}); "
                f"megatron-lite does not unpickle them."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
