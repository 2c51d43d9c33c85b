"""Local copies of objects for readers that need files (tokenizers, Hugging Face directories, JSONL corpora), and
local directories published to a store for writers that make files (exports).

Inputs are downloaded once per content: a file is named by its URL, ETag and size (:func:`cached_copy`), a directory
(every object under a prefix) by its URL and the ETags and sizes of all its objects (:func:`cached_directory`); a
changed object is downloaded again, an unchanged one never. Both land atomically (a file by rename, a directory by
renaming the folder it was downloaded into), so a half-downloaded copy is never handed out and concurrent processes
at worst download twice. Outputs (:func:`published_directory`) are written to a local folder and uploaded when the
writer finished without an error, the files named ``last`` (a directory's marker, e.g. an HF ``config.json``) after
all others, so a reader that needs them never sees an upload cut short as complete.

Where the copies go: ``$XDG_CACHE_HOME/megatron-lite/object-store`` (``~/.cache/...``), :func:`object_cache_dir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional, Sequence

from megatron_lite.core.object_store import errors_named, filesystem, is_remote


def object_cache_dir() -> str:
    """Where local copies of objects (``.idx`` files, tokenizers, HF directories, index caches) are kept."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(user_cache, "megatron-lite", "object-store")


def url_digest(url: str) -> str:
    """A short name for ``url`` in local cache paths."""
    return hashlib.md5(url.encode()).hexdigest()[:16]


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or "").strip('"')


def object_identity(url: str) -> tuple[int, str]:
    """(size, ETag) of the object at ``url``, asked afresh; ``FileNotFoundError`` naming it when there is none."""
    fs = filesystem(url)
    with errors_named(url):
        fs.invalidate_cache(url)
        info = fs.info(url)
    return int(info["size"]), _etag(info)


def _write_file_atomically(path: str, data: bytes) -> None:
    """``data`` at ``path`` by rename: a reader sees the whole file or none."""
    handle, partial = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def cached_copy(url: str, cache_dir: Optional[str] = None) -> str:
    """A local copy of the object ``url``, downloaded once per ETag and size into ``cache_dir`` (default
    :func:`object_cache_dir`); written atomically, so concurrent ranks at worst download it twice."""
    size, etag = object_identity(url)
    directory = cache_dir or object_cache_dir()
    os.makedirs(directory, exist_ok=True)
    name = url.rstrip("/").rsplit("/", 1)[-1]
    path = os.path.join(directory, f"{url_digest(url)}-{etag or 'no-etag'}-{size}-{name}")
    if not os.path.isfile(path) or os.path.getsize(path) != size:
        with errors_named(url):
            data = filesystem(url).cat_file(url)
        if len(data) != size:
            raise ValueError(f"{url}: read {len(data)} bytes, but the object has {size}: it changed while it was read")
        _write_file_atomically(path, data)
    return path


def objects_under(url: str) -> dict[str, tuple[int, str]]:
    """``{name relative to the prefix url: (size, ETag)}`` of every object under the prefix ``url``, listed afresh
    (``{}`` when there is none)."""
    fs, prefix = filesystem(url), url.rstrip("/")
    with errors_named(url):
        fs.invalidate_cache(prefix)
        try:
            listing = fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
    bare = prefix.split("://", 1)[-1]
    return {
        path.split("://", 1)[-1][len(bare) + 1 :]: (int(info["size"]), _etag(info))
        for path, info in listing.items()
        if info.get("type") != "directory" and path.split("://", 1)[-1].startswith(bare + "/")
    }


def cached_directory(url: str, cache_dir: Optional[str] = None, exclude: Sequence[str] = ()) -> str:
    """A local copy of every object under the prefix ``url`` (a directory in the store), keeping their relative
    names; downloaded once per listing (names, ETags, sizes) into ``cache_dir`` (default :func:`object_cache_dir`).
    ``exclude``: name endings of objects left out (a checkpoint's tensor shards, ``.distcp``, for a reader of its
    metadata). ``FileNotFoundError`` naming ``url`` when nothing is under it."""
    fs, prefix = filesystem(url), url.rstrip("/")
    listed = objects_under(prefix)
    if not listed:
        raise FileNotFoundError(f"{url}: no objects under this prefix (is the URL right?)")
    objects = {name: identity for name, identity in listed.items() if not name.endswith(tuple(exclude))}
    content = hashlib.md5(json.dumps(sorted(objects.items())).encode()).hexdigest()[:16]
    root = cache_dir or object_cache_dir()
    target = os.path.join(root, f"{url_digest(prefix)}-{content}-{prefix.rsplit('/', 1)[-1]}")
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    partial = tempfile.mkdtemp(dir=root, prefix=".partial-")
    try:
        for relative, (size, _) in objects.items():
            local = os.path.join(partial, *relative.split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with errors_named(f"{prefix}/{relative}"):
                fs.get_file(f"{prefix}/{relative}", local)
            if os.path.getsize(local) != size:
                raise ValueError(f"{prefix}/{relative}: read {os.path.getsize(local)} bytes of {size}: it changed")
        try:
            os.rename(partial, target)
        except OSError:  # another process finished the same copy first: its copy is the same content
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def local_input(value: str | os.PathLike[str]) -> str:
    """``value`` itself for a local path; for a URL, the local copy of the object or of the prefix's objects."""
    if not is_remote(value):
        return os.fspath(value)
    url = os.fspath(value).rstrip("/")
    fs = filesystem(url)
    with errors_named(url):
        fs.invalidate_cache(url)
        single = fs.isfile(url)
    return cached_copy(url) if single else cached_directory(url)


@contextlib.contextmanager
def published_directory(url: str, last: Sequence[str] = (), replace: bool = False) -> Iterator[str]:
    """A fresh local folder to write a directory into; when the block ends without an error its files are uploaded
    under the prefix ``url`` (``last``: names relative to the folder uploaded after all others) and the folder is
    removed. On an error nothing is uploaded. ``replace``: the objects already under ``url`` are deleted before the
    upload, the ``last`` ones first, so what a kill leaves there is never taken for a complete directory (the caller
    decided that they may go: :func:`~megatron_lite.core.checkpoint.format.output_dir.check_output`)."""
    root = object_cache_dir()
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(dir=root, prefix=".outgoing-")
    try:
        yield folder
        files = sorted(
            os.path.relpath(os.path.join(directory, name), folder).replace(os.sep, "/")
            for directory, _, names in os.walk(folder)
            for name in names
        )
        fs, prefix = filesystem(url), url.rstrip("/")
        if replace:
            for relative in sorted(objects_under(prefix), key=lambda name: name not in last):
                with errors_named(f"{prefix}/{relative}"):
                    fs.rm_file(f"{prefix}/{relative}")
        for relative in sorted(files, key=lambda name: name in last):
            with errors_named(f"{prefix}/{relative}"):
                fs.put_file(os.path.join(folder, relative), f"{prefix}/{relative}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
