"""What every ``megatron-lite`` verb shares: its exit codes, one line for a mistake the user can fix, ``--json``
output, and a reader that leaves early (``megatron-lite checkpoint inspect CKPT | head``).

A verb's ``main(argv) -> int`` parses its arguments, runs its work through :func:`run_verb` (a user error ->
``megatron-lite VERB: error: <one line>`` on stderr and :data:`EXIT_USAGE`) and prints the result with
:func:`print_result`. The dispatch (:func:`megatron_lite.cli.main`) runs every verb under
:func:`closing_quietly_on_broken_pipe`. Set ``MEGATRON_LITE_DEBUG=1`` to get the traceback of a user error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar

from megatron_lite.utils.optional import MissingDependencyError

T = TypeVar("T")

EXIT_OK = 0
"""The verb did what it was asked."""
EXIT_FAILED = 1
"""The verb ran and found a problem (``checkpoint inspect``: a corrupted file)."""
EXIT_USAGE = 2
"""Bad input, said in one line that names the fix (argparse's code for a usage error too)."""
EXIT_BROKEN_PIPE = 128 + getattr(signal, "SIGPIPE", 13)
"""The reader of standard output left (what a shell reports for a tool that SIGPIPE ended)."""

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError, MissingDependencyError)
"""What our checks raise for input the user can fix (the last: an optional package the input needs)."""
DEBUG_VARIABLE = "MEGATRON_LITE_DEBUG"
"""Set (to anything) to see the traceback of a user error instead of its one line."""

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def one_line(error: BaseException) -> str:
    """The error's message on one line (a wrapped message's line breaks and indents become single spaces)."""
    return " ".join(str(error).split())


def report_user_error(prog: str, error: BaseException) -> int:
    """Print ``<prog>: error: <one line>`` on stderr and return :data:`EXIT_USAGE`; with ``MEGATRON_LITE_DEBUG``
    set, raise ``error`` instead (its traceback)."""
    if os.environ.get(DEBUG_VARIABLE):
        raise error
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return EXIT_USAGE


def parse_arguments(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace | int:
    """``parser.parse_args(argv)``, or the exit code argparse ends with instead of its SystemExit (``--help``: 0, a
    usage error: 2, its message printed), for the verbs whose ``main`` returns its code in every case."""
    try:
        return parser.parse_args(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else EXIT_USAGE


def run_verb(
    prog: str,
    work: Callable[[], T],
    show: Callable[[T], Optional[int]],
    errors: tuple[type[BaseException], ...] = USER_ERRORS,
) -> int:
    """``show(work())``: the verb's work, then its printing, which returns the exit code (None: :data:`EXIT_OK`).
    An ``errors`` raised by the work is reported in one line (:func:`report_user_error`); anything else is a bug
    and keeps its traceback."""
    try:
        result = work()
    except errors as error:
        return report_user_error(prog, error)
    status = show(result)
    return EXIT_OK if status is None else status


def print_result(result: Any, as_json: bool, text: Callable[[Any], str], indent: Optional[int] = None) -> None:
    """Print ``result`` as one JSON document (``--json``) or as ``text(result)`` for people."""
    print(json.dumps(result, indent=indent) if as_json else text(result))


def closing_quietly_on_broken_pipe(run: Callable[[], T]) -> T | int:
    """``run()``, except that a reader that stopped reading (``megatron-lite checkpoint inspect CKPT | head``) ends
    it quietly, as it ends Unix tools: no ``BrokenPipeError`` traceback, :data:`EXIT_BROKEN_PIPE`."""
    try:
        status = run()
        sys.stdout.flush()  # what is still buffered goes now, where its failure is caught
        return status
    except BrokenPipeError:
        if not _stdout_is_closed():
            raise
        # Python flushes stdout again at exit and would report the same error: point it at /dev/null
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _stdout_is_closed() -> bool:
    """Whether standard output is a pipe whose reader is gone (a broken socket elsewhere is not)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() on this platform, or stdout is not a file
        return True


def our_configuration_error(error: BaseException) -> Optional[BaseException]:
    """The root cause of ``error`` if it is one of our own validation errors, else None: for the verbs that let
    errors through (``fit``/``validate``/``test``/``predict``, ``generate``), the dispatch reports these in one
    line.

    Our checks raise ValueError/TypeError/FileNotFoundError (and MissingDependencyError for an optional package a
    configured class needs) with a message that names the fix; a user should see that message, not the stack of
    jsonargparse and Lightning wrapped around it. Anything raised elsewhere is a bug and keeps its traceback.
    """
    chain = [error]
    while chain[-1].__cause__ is not None:  # explicit `raise ... from` chains only
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    if (
        isinstance(root, (ValueError, TypeError, FileNotFoundError, MissingDependencyError))
        and root.__traceback__ is not None
        and traceback.extract_tb(root.__traceback__)[-1].filename.startswith(_PACKAGE_DIR)
    ):
        return root
    # Our error may only survive as text, inside jsonargparse's report on a Union-typed value.
    return next((e for e in map(_error_in_union_value, chain[:-1]) if e is not None), None)


def _error_in_union_value(error: BaseException) -> Optional[ValueError]:
    """Our own error inside jsonargparse's "Does not validate against any of the Union subtypes", else None.

    A class of ours given where a Union is expected (``Trainer(strategy: str | Strategy)``, so any
    ``MegatronStrategy`` option from YAML) that refuses its arguments is reported by jsonargparse as text,
    one ``  - <message>`` line per subtype it tried (the first subtype's error, not ours, chained as the cause).
    """
    text = str(error)
    if (
        not text.startswith("Does not validate against any of the Union subtypes")
        or "class_path='megatron_lite." not in text
    ):
        return None
    errors = text.split("\nErrors:\n", 1)[-1].split("\nGiven value type:", 1)[0]
    ours = [
        line.strip()[2:]
        for line in errors.splitlines()
        if line.strip().startswith("- ") and not line.strip().startswith("- Expected a ")
    ]
    return ValueError(" ".join(ours)) if ours else None
