"""Paths are local, except where object storage is supported: a URL is refused by name (``s3://data/shk`` once wrote
a local folder ``s3:``) unless it is an ``s3://`` URL given where checkpoints or data may live in an object store
(see docs/object-storage.md); every other scheme (``gs://``, ``hf://``, ``https://``, ...) is refused everywhere."""

from __future__ import annotations

import argparse
import os
import re
from typing import Optional, TypeVar

from megatron_lite.core.object_store import SUPPORTED_SCHEMES, scheme_of

P = TypeVar("P", str, "os.PathLike[str]")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_FIX = (
    "object storage is not supported yet: copy the data to a local or network file system path and give that "
    "path (write outputs there and copy them to the store afterwards)"
)
_SCHEMES = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
_FIX_SCHEME = (
    f"only {_SCHEMES} object storage is supported (see docs/object-storage.md); copy the data to a local path or an "
    f"S3-compatible store"
)


class ObjectStorageURLError(ValueError):
    """A URL given where a local (or mounted network file system) path is needed."""


def is_url(value: str | os.PathLike[str]) -> bool:
    """Whether ``value`` is a ``scheme://...`` URL (a Windows drive letter, ``C:\\``, is not)."""
    return bool(_URL.match(os.fspath(value)))


def require_local_path(value: Optional[P], what: str) -> Optional[P]:
    """``value`` itself when it is None or not a URL; else :class:`ObjectStorageURLError` naming ``what`` (the
    option or argument, e.g. ``--output-prefix``) and the URL, before anything is read or written."""
    if value is not None and is_url(value):
        raise ObjectStorageURLError(f"{what} {os.fspath(value)!r} is a URL; {_FIX}")
    return value


def require_local_or_object_path(value: Optional[P], what: str) -> Optional[P]:
    """``value`` itself when it is None, a local path or a URL of a supported object store (``s3://``); else
    :class:`ObjectStorageURLError` naming ``what``, the URL and the schemes that are supported."""
    if value is not None and is_url(value) and scheme_of(value) not in SUPPORTED_SCHEMES:
        raise ObjectStorageURLError(f"{what} {os.fspath(value)!r} is a URL of an unsupported scheme; {_FIX_SCHEME}")
    return value


def local_or_object_path_argument(value: str) -> str:
    """``type=`` of an argparse option that takes a local path or a URL of a supported object store (``s3://``)."""
    if is_url(value) and scheme_of(value) not in SUPPORTED_SCHEMES:
        raise argparse.ArgumentTypeError(f"{value!r} is a URL of an unsupported scheme; {_FIX_SCHEME}")
    return value


def local_path_argument(value: str) -> str:
    """``type=`` of an argparse option that takes a path: a URL is a usage error (argparse names the option)."""
    if is_url(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a URL; {_FIX}")
    return value
