"""Cache files shared between processes: an exclusive lock for building, atomic writes for readers."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # not POSIX: no locking; the atomic renames still keep readers safe
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def locked(lock_path: str) -> Iterator[None]:
    """Exclusive advisory lock on ``lock_path`` (created if missing), so concurrent processes build once.

    Readers need no lock: files appear only through ``write_atomic``.
    """
    if fcntl is None:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it: readers never see a partial file."""
    # a plain exclusive open (not mkstemp) so the file gets the umask's permissions and the cache can be shared
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
