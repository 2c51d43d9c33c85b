"""Corpora shipped inside the package, by name: configs say ``path: shakespeare`` and work from any directory."""

from __future__ import annotations

import os
from pathlib import Path

_CORPORA_DIR = Path(__file__).resolve().parent / "corpora"
_SUFFIX = ".jsonl.gz"


def bundled_corpora() -> list[str]:
    """Names of the corpora shipped with the package (``["shakespeare"]``)."""
    return sorted(p.name.removesuffix(_SUFFIX) for p in _CORPORA_DIR.glob(f"*{_SUFFIX}"))


def bundled_corpus(name: str = "shakespeare") -> str:
    """Path of a corpus shipped with the package (``"shakespeare"``: 42 works, public domain)."""
    path = _CORPORA_DIR / f"{name}{_SUFFIX}"
    if not path.is_file():
        raise FileNotFoundError(f"no bundled corpus {name!r}; available: {bundled_corpora()}")
    return str(path)


def resolve_corpus(path: str | os.PathLike[str]) -> str:
    """``path`` if it is a file, else the bundled corpus of that name; one error naming both choices.

    A file wins over a bundled name, so a local file that happens to be called ``shakespeare`` is still read.
    Relative paths stay relative to the working directory, as every other path in a config.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    if path in bundled_corpora():
        return bundled_corpus(path)
    raise FileNotFoundError(
        f"corpus {path} does not exist; pass data.path=<a .jsonl or .jsonl.gz file> or the name "
        f"of a bundled corpus: {', '.join(bundled_corpora())}"
    )
