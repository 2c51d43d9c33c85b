"""Object storage (``s3://bucket/key``) beside local paths: the few file operations checkpoints and datasets need,
through ``fsspec`` and its S3 backend ``s3fs`` (``pip install 'megatron-lite[s3]'``).

The endpoint and the credentials are what botocore finds by itself: ``AWS_ENDPOINT_URL`` (MinIO, Ceph, a local
server), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``~/.aws/config``; so are its retries
(``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``: a bounded number of attempts with exponential backoff). A failure that
retries did not cure is raised as :class:`ObjectStoreError` naming the URL and what to fix (:func:`storage_error`).

Paths are kept as they are given: a local path as a :class:`~pathlib.Path`, a URL as a ``str`` (``Path`` would fold
``s3://b`` into ``s3:/b``); :func:`location` and :func:`join` build them, the readers below take either.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import IO, Any, Iterator, Union

Location = Union[Path, str]
"""A local path, or the URL of an object (or prefix) in a store."""

SUPPORTED_SCHEMES = ("s3",)
"""The URL schemes checkpoints (and indexed datasets) may live at."""

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_INSTALL = "pip install 'megatron-lite[s3]' (it adds s3fs, the fsspec backend for S3)"
_CREDENTIALS = (
    "check the credentials botocore finds (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials) "
    "and that they may read and write the bucket"
)


class ObjectStoreError(OSError):
    """An object store could not be used: a missing bucket, refused credentials, an unreachable endpoint."""


def scheme_of(value: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``value`` (``"s3"``), or None for a local path."""
    match = _URL.match(os.fspath(value))
    return match["scheme"].lower() if match else None


def is_remote(value: str | os.PathLike[str]) -> bool:
    """Whether ``value`` is an object-store URL (a ``scheme://`` other than ``file://``)."""
    scheme = scheme_of(value)
    return scheme is not None and scheme != "file"


def location(value: str | os.PathLike[str]) -> Location:
    """``value`` as a :data:`Location`: the URL string itself, or a local ``Path``."""
    return os.fspath(value).rstrip("/") if is_remote(value) else Path(value)


def join(base: Location, *names: str) -> Location:
    """``base / name / ...`` for a local path or a URL."""
    if isinstance(base, Path):
        return base.joinpath(*names)
    return "/".join([base.rstrip("/"), *names])


def name_of(value: Location) -> str:
    """The last part of a path or URL (``step=4`` of ``s3://b/run/step=4``)."""
    return value.name if isinstance(value, Path) else value.rstrip("/").rsplit("/", 1)[-1]


def parent_of(value: Location) -> Location:
    return value.parent if isinstance(value, Path) else value.rstrip("/").rsplit("/", 1)[0]


def filesystem(url: str) -> Any:
    """The fsspec file system serving ``url`` (cached by fsspec per process and settings)."""
    from fsspec.core import url_to_fs  # a dependency of torch

    try:
        fs, _ = url_to_fs(url)
    except ImportError:
        raise ObjectStoreError(f"{url}: the {scheme_of(url)}:// backend is not installed; {_INSTALL}") from None
    return fs


def storage_error(url: str, error: BaseException) -> BaseException:
    """``error`` from an object store, as one error naming ``url`` and the fix (the error itself when it says
    nothing about the store: a missing object stays a ``FileNotFoundError`` for the caller to explain)."""
    text = f"{type(error).__name__}: {error}"
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    if isinstance(error, ObjectStoreError):
        return error
    if "NoSuchBucket" in text or "bucket does not exist" in text:
        return ObjectStoreError(
            f"{url}: the bucket {bucket!r} does not exist at the endpoint (AWS_ENDPOINT_URL={_endpoint()}); create it "
            f"(aws s3 mb s3://{bucket}) or fix the URL"
        )
    if isinstance(error, PermissionError) or any(
        code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")
    ):
        return ObjectStoreError(f"{url}: access denied ({error}); {_CREDENTIALS}")
    if _unreachable(error):
        return ObjectStoreError(
            f"{url}: the object store at {_endpoint()} cannot be reached ({error}), after botocore's retries with "
            f"backoff (AWS_MAX_ATTEMPTS sets how many); check that the server is up and AWS_ENDPOINT_URL points at it"
        )
    if isinstance(error, ImportError):
        return ObjectStoreError(f"{url}: {error}; {_INSTALL}")
    return error


def _unreachable(error: BaseException) -> bool:
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionError"})


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's default"


@contextlib.contextmanager
def errors_named(url: str) -> Iterator[None]:
    """Re-raise what the store raised inside the block as :func:`storage_error` of ``url``."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - mapped, or re-raised as it was
        mapped = storage_error(url, error)
        if mapped is error:
            raise
        raise mapped from None


def check_bucket(url: str) -> None:
    """Raise :class:`ObjectStoreError` (naming ``url`` and the fix) unless the bucket of ``url`` exists and the
    credentials may list it -- before a run starts, instead of at its first checkpoint."""
    fs = filesystem(url)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    with errors_named(url):
        fs.ls(bucket, refresh=True)


# --- reading and writing whole files -----------------------------------------------------
def read_bytes(path: Location) -> bytes:
    """The whole content of a local file or an object (``FileNotFoundError`` when there is none)."""
    if isinstance(path, Path):
        return path.read_bytes()
    with errors_named(path):
        return filesystem(path).cat_file(path)


def write_bytes(path: Location, data: bytes) -> None:
    """Write a whole object (one PUT: readers see all of it or nothing). Local files are written by the callers'
    own durable writes."""
    assert isinstance(path, str), "local files are written durably by the checkpoint's commit code"
    with errors_named(path):
        filesystem(path).pipe_file(path, data)


def upload(local: str, url: str) -> None:
    """Copy the local file ``local`` to the object ``url`` (a multipart upload when large)."""
    with errors_named(url):
        filesystem(url).put_file(local, url)


def file_size(path: Location) -> int:
    if isinstance(path, Path):
        return path.stat().st_size
    with errors_named(path):
        return int(filesystem(path).info(path)["size"])


def open_read(path: Location) -> IO[bytes]:
    """``path`` opened for reading (a buffered object stream for a URL)."""
    if isinstance(path, Path):
        return open(path, "rb")
    with errors_named(path):
        return filesystem(path).open(path, "rb")


def is_file(path: Location) -> bool:
    if isinstance(path, Path):
        return path.is_file()
    with errors_named(path):
        return bool(filesystem(path).isfile(path))
