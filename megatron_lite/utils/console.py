"""What a command-line verb does when the program reading its output goes away (``... | head``)."""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _stdout_is_closed() -> bool:
    """Whether standard output is a pipe whose reader is gone (a broken socket elsewhere is not)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() on this platform, or stdout is not a file
        return True


def exits_quietly_on_broken_pipe(main: Callable[..., T]) -> Callable[..., T | int]:
    """Wrap a verb's ``main`` so that a reader that stopped reading (``megatron-lite checkpoint inspect CKPT |
    head``) ends it quietly, as it ends Unix tools: no ``BrokenPipeError`` traceback, exit status 141
    (128 + SIGPIPE, what a shell reports for a tool that SIGPIPE ended)."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # what is still buffered goes now, where its failure is caught
            return result
        except BrokenPipeError:
            if not _stdout_is_closed():
                raise
            # Python flushes stdout again at exit and would report the same error: point it at /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 128 + getattr(signal, "SIGPIPE", 13)

    return wrapped
