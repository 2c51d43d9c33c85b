"""Reading JSON-lines corpora (plain or gzipped) with errors that name ``file:line`` and the fix."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import IO, Any

_GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: str | os.PathLike[str]) -> IO[str]:
    """Open a UTF-8 text file, gunzipped when it starts with gzip's magic bytes (whatever its name)."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rt", encoding="utf-8") if gzipped else open(path, encoding="utf-8")


def require_object(value: Any, where: str, key: str, *, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """``value`` if it is a JSON object (dict); else ``error`` naming ``where`` and the ``key`` that was wanted."""
    if not isinstance(value, dict):
        raise error(f"{where} is a JSON {type(value).__name__}, not an object with a {key!r} key")
    return value


def parse_object_line(
    line: str, where: str, key: str, *, what: str = "the corpus", error: type[ValueError] = ValueError,
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
    path: str, json_key: str = "text", *, what: str = "the corpus", option: str = "json_key",
) -> Iterator[str]:
    """The non-empty strings under ``json_key``, one JSON object per line; blank lines are skipped.

    A malformed line raises ValueError naming ``path:line`` and the fix; ``what`` names the input and
    ``option`` the caller's setting for the key (e.g. ``data.json_key``), so the message says what to change.
    """
    key_seen = False  # once earlier lines had the key, a line without it is the line to fix
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            obj = parse_object_line(line, where, json_key, what=what)
            if obj is None:
                continue
            if json_key not in obj:
                fix = ("every line needs it: fix or remove this line" if key_seen
                       else f"pass {option}=<one of them>")
                raise ValueError(f"{where} has no key {json_key!r} (its keys: {sorted(obj)}); {fix}")
            key_seen = True
            text = obj[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{where}: {json_key!r} is a {type(text).__name__}, not a string")
            if text:
                yield text
