"""Reading preprocessing inputs (main process): JSON lines, JSON arrays, parquet, saved ``datasets``, in chunks.

JSON lines are handed on raw (the tokenizing workers parse them, so parsing runs in parallel), everything
else as dict rows; chunks of them are what the workers receive. Nothing is ever fetched from the hub.

Inputs may be objects in a store (``s3://bucket/key``, globs over a prefix too): JSON (lines) and parquet files are
streamed by ranged reads, never downloaded whole; a ``save_to_disk`` directory, which ``datasets`` memory-maps, is
copied to the local object cache first (:func:`~megatron_lite.core.object_staging.local_input`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from megatron_lite.core.object_staging import local_input
from megatron_lite.core.object_store import errors_named, filesystem, is_file, is_remote, join, location, open_read
from megatron_lite.utils.jsonl import decode_utf8, open_bytes, read_lines
from megatron_lite.utils.optional import require

# a chunk also closes at this many characters: big documents then spread over workers instead of one
# worker holding a chunk of many big ones at the end of the run
_CHUNK_CHARS = 1 << 16
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


class PreprocessError(ValueError):
    """Bad input or configuration found while preprocessing; the message names the file and the fix."""


def resolve_inputs(patterns: Sequence[str]) -> list[str]:
    """Files (or ``save_to_disk`` directories) named or matched by ``patterns``, in order; each must match."""
    paths: list[str] = []
    for pattern in patterns:
        if is_remote(pattern):
            matches = object_matches(pattern)
        else:
            matches = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern]
            matches = matches if matches and os.path.exists(matches[0]) else []
        if not matches:
            raise FileNotFoundError(
                f"--input {pattern}: no such file or directory; pass a .jsonl[.gz], .parquet or "
                f"a datasets save_to_disk directory (globs allowed)"
            )
        paths.extend(matches)
    return paths


def object_matches(pattern: str) -> list[str]:
    """The URLs of the objects (or prefixes) ``pattern`` names or, with wildcards, matches; [] when none."""
    fs = filesystem(pattern)
    with errors_named(pattern):
        fs.invalidate_cache()
        if glob.has_magic(pattern):
            return sorted(fs.unstrip_protocol(path) for path in fs.glob(pattern))
        return [pattern] if fs.exists(pattern) else []


def is_dir(path: str) -> bool:
    """Whether ``path`` is a local directory or a prefix of objects in a store."""
    if not is_remote(path):
        return os.path.isdir(path)
    with errors_named(path):
        return bool(filesystem(path).isdir(path))


def input_kind(path: str) -> str:
    """``"hf"``, ``"parquet"`` or ``"json"``; PreprocessError for anything else."""
    if is_dir(path):
        if any(is_file(join(location(path), name)) for name in ("state.json", "dataset_dict.json")):
            return "hf"
        raise PreprocessError(
            f"{path} is a directory but not a `datasets` save_to_disk directory (no state.json or "
            f"dataset_dict.json); pass its data files instead, e.g. --input '{path}/*.parquet'"
        )
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_JSON_SUFFIXES):
        return "json"
    raise PreprocessError(
        f"{path}: unsupported input format; use JSON lines (.jsonl/.json, optionally .gz), "
        f".parquet, or a datasets save_to_disk directory"
    )


def _check_columns(path: str, present: Sequence[str], keys: Sequence[str]) -> None:
    """PreprocessError naming the missing keys and the columns that exist."""
    missing = [k for k in keys if k not in present]
    if missing:
        raise PreprocessError(
            f"{path} has no column {', '.join(map(repr, missing))} (columns: {list(present)}); "
            f"pass --json-keys with the column that holds the text"
        )


def read_items(path: str, keys: Sequence[str], hf_split: str) -> tuple[str, Iterator[Any], Optional[int]]:
    """``(location kind, items, count or None)``: raw JSON lines (kind ``line``) or dict rows (``record``)."""
    kind = input_kind(path)
    if kind == "parquet":
        pq = require("pyarrow.parquet", f"reading parquet input {path}")

        try:
            table = pq.ParquetFile(open_read(path) if is_remote(path) else path)  # an object: ranged reads
        except Exception as err:  # pyarrow's errors do not name the file
            raise PreprocessError(f"{path} is not a readable parquet file ({err})") from None
        _check_columns(path, table.schema_arrow.names, keys)
        batches = table.iter_batches(batch_size=1024, columns=list(keys))
        return "record", (row for batch in batches for row in batch.to_pylist()), table.metadata.num_rows
    if kind == "hf":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # belt and braces: a local directory, never the hub
        datasets = require("datasets", f"reading the saved Hugging Face dataset {path}")

        local = local_input(path)  # datasets memory-maps the directory: one in a store is copied first
        try:
            ds = datasets.load_from_disk(local)
        except Exception as err:  # a damaged directory: say which one
            raise PreprocessError(
                f"{path}: cannot load the saved dataset ({err}); save it again with save_to_disk"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if hf_split not in ds:
                raise PreprocessError(f"{path} holds splits {list(ds)}, not {hf_split!r}; pass --hf-split <split>")
            ds = ds[hf_split]
        _check_columns(path, ds.column_names, keys)
        ds = ds.select_columns(list(keys))
        return (
            "record",
            (
                row
                for batch in ds.iter(batch_size=1024)
                for row in (dict(zip(keys, vals)) for vals in zip(*(batch[k] for k in keys)))
            ),
            len(ds),
        )
    with open_bytes(path) as f:  # its first bytes tell JSON lines from an array (a cut character is harmless)
        head = f.read(4096).decode("utf-8", errors="ignore").lstrip()
    if head.startswith("["):  # one JSON array of objects rather than JSON lines
        with open_bytes(path) as f:
            text = decode_utf8(f.read(), path)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise PreprocessError(f"{path} is not valid JSON ({err}); use one JSON object per line") from err
        return "record", iter(rows), len(rows)

    def lines() -> Iterator[str]:
        number = 0
        try:
            # a line that is not UTF-8: a ValueError naming it; `number` names the line a read error stopped at
            for number, line in read_lines(path):  # noqa: B007
                yield line
        except (EOFError, OSError) as err:  # mid-file: corrupt or truncated
            raise PreprocessError(
                f"{path}:{number + 1} cannot be read ({err}); the file is corrupt or truncated "
                f"(inputs must be UTF-8 text, optionally gzipped)"
            ) from None

    return "line", lines(), None


def chunk_items(path: str, kind: str, items: Iterator[Any], chunk_size: int) -> Iterator[tuple[str, str, int, list]]:
    """``(path, kind, number of the first item, items)`` of at most ``chunk_size`` items / ~64 KiB of text."""
    chunk: list = []
    chars, first = 0, 1
    for number, item in enumerate(items, start=1):
        if not chunk:
            first = number
        chunk.append(item)
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            chars += sum(len(v) for v in item.values() if isinstance(v, str))
        if len(chunk) >= chunk_size or chars >= _CHUNK_CHARS:
            yield path, kind, first, chunk
            chunk, chars = [], 0
    if chunk:
        yield path, kind, first, chunk
