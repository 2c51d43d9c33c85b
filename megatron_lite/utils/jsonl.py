"""Reading JSON-lines corpora (plain or gzipped, UTF-8) with errors that name ``file:line`` and the fix.

A corpus may be a local file or an object in a store (``s3://bucket/key``): an object is streamed (read ahead in
blocks by ranged reads), never downloaded whole, so it may be larger than the local disk."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Iterator
from typing import IO, Any

from megatron_lite.core.object_store import is_remote, open_read

_GZIP_MAGIC = b"\x1f\x8b"


def _open_raw(path: str | os.PathLike[str]) -> IO[bytes]:
    """A local file, or an object streamed from its store (``FileNotFoundError`` naming the URL when there is none)."""
    if not is_remote(path):
        return open(path, "rb")
    url = os.fspath(path)
    try:
        return open_read(url)
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no such object in the store; check the bucket and the key") from None


@contextlib.contextmanager
def open_bytes(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A local file or an object (a URL) open for reading bytes, gunzipped when it starts with gzip's magic bytes
    (whatever its name); closed at the end of the ``with`` block."""
    with _open_raw(path) as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        if not gzipped:
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
            yield unzipped


def read_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file or object (gunzipped as :func:`open_bytes` does), newline included.

    Each line is decoded on its own, so a byte that is not UTF-8 raises ValueError naming ``file:line``, the byte
    and the fix (a text stream decodes blocks ahead of the line it hands out and names neither).
    """
    with open_bytes(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(_not_utf8(path, number, raw, err)) from None


def decode_utf8(data: bytes, path: str | os.PathLike[str]) -> str:
    """``data`` (the whole of ``path``) as text; ValueError naming the line of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        start = data.rfind(b"\n", 0, err.start) + 1
        end = data.find(b"\n", err.start)
        line = data[start:] if end < 0 else data[start : end + 1]
        moved = UnicodeDecodeError(err.encoding, line, err.start - start, err.end - start, err.reason)
        raise ValueError(_not_utf8(path, data.count(b"\n", 0, err.start) + 1, line, moved)) from None


def _not_utf8(path: str | os.PathLike[str], line_no: int, line: bytes, err: UnicodeDecodeError) -> str:
    """The one-line message for a line that is not UTF-8: where, which byte, and how to fix the file."""
    return (
        f"{os.fspath(path)}:{line_no}: byte {err.start + 1} of the line ({line[err.start]:#04x}) is not UTF-8 "
        f"({err.reason}); the input must be UTF-8 text: convert the file (e.g. `iconv -f latin1 -t utf-8 "
        f"{os.fspath(path)} > <new file>`) or remove the line"
    )


def require_object(value: Any, where: str, key: str, *, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """``value`` if it is a JSON object (dict); else ``error`` naming ``where`` and the ``key`` that was wanted."""
    if not isinstance(value, dict):
        raise error(f"{where} is a JSON {type(value).__name__}, not an object with a {key!r} key")
    return value


def parse_object_line(
    line: str,
    where: str,
    key: str,
    *,
    what: str = "the corpus",
    error: type[ValueError] = ValueError,
) -> dict[str, Any] | None:
    """The JSON object on one line, or None for a blank line.

    ``where`` (e.g. ``"corpus.jsonl:3"``) starts every message, ``key`` is the key the caller wants (named when
    the line holds no object), ``what`` names the input in the fix, and ``error`` is the ValueError subclass
    to raise (e.g. a tool's own error type).
    """
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise error(f"{where} is not valid JSON ({err}); {what} must hold one JSON object per line") from err
    return require_object(obj, where, key, error=error)


def iter_jsonl_texts(
    path: str,
    json_key: str = "text",
    *,
    what: str = "the corpus",
    option: str = "json_key",
) -> Iterator[str]:
    """The non-empty strings under ``json_key``, one JSON object per line; blank lines are skipped.

    A malformed line raises ValueError naming ``path:line`` and the fix; ``what`` names the input and
    ``option`` the caller's setting for the key (e.g. ``data.json_key``), so the message says what to change.
    """
    key_seen = False  # once earlier lines had the key, a line without it is the line to fix
    for line_no, line in read_lines(path):
        where = f"{path}:{line_no}"
        obj = parse_object_line(line, where, json_key, what=what)
        if obj is None:
            continue
        if json_key not in obj:
            fix = "every line needs it: fix or remove this line" if key_seen else f"pass {option}=<one of them>"
            raise ValueError(f"{where} has no key {json_key!r} (its keys: {sorted(obj)}); {fix}")
        key_seen = True
        text = obj[json_key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: {json_key!r} is a {type(text).__name__}, not a string")
        if text:
            yield text
