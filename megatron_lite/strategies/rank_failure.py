"""The first rank's error, for every rank and for the launching process.

When one rank raises after launch, the others fail soon after inside a collective ("Connection closed
by peer" from gloo): their errors are consequences. The first rank to fail records its exception in
the run's directory (a file created exclusively, so exactly one rank wins) *before* it tears its process
groups down -- the peers' collective errors can only come after that. Then:

- the launching process of a fork/spawn run raises the recorded exception instead of torch's
  ``ProcessRaisedException`` about whichever rank it noticed first;
- under the script launcher ('popen'), rank 0 (the user's script) raises the recorded exception, and
  the other ranks whose error is a consequence exit with status 1 without printing.

The raised exception has the recorded type and arguments when that type is already imported in the
raising process and accepts them (else a RuntimeError naming it); its ``__cause__`` carries the failing
rank's traceback. The record is JSON: nothing is unpickled.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

RUN_DIR_ENV = "MEGATRON_LITE_RUN_DIR"
"""Environment variable naming the run directory, for ranks started as scripts (they inherit it)."""


# Runs started by this process so far. Every rank of a script re-runs the same script, so the n-th run
# of each process is the same run: its failure record is named after n.
_RUNS = itertools.count()


def next_run_number() -> int:
    """The number of the run this process starts now (0, 1, ...)."""
    return next(_RUNS)


class RankFailure(RuntimeError):
    """The failing rank's traceback (the cause of the exception re-raised for it)."""


def record_failure(path: Optional[str], rank: int, error: BaseException) -> bool:
    """Record ``error`` as the run's first failure; False when another rank already did (or no run
    directory exists). Written to a private file, then linked into place: readers never see half a
    record, and the link fails if a record exists."""
    if not path or not os.path.isdir(os.path.dirname(path)):
        return False
    if os.path.exists(path):
        return False
    try:
        args = list(error.args)
        json.dumps(args)
    except (TypeError, ValueError):
        args = None
    record = {
        "rank": rank,
        "module": type(error).__module__,
        "qualname": type(error).__qualname__,
        "args": args,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    }
    tmp = f"{path}.rank{rank}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        return False  # the run directory went away (the launching process has finished)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_failure(path: Optional[str]) -> Optional[dict[str, Any]]:
    """The recorded first failure, or None."""
    if not path or not os.path.isfile(path):
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _exception_type(record: dict[str, Any]) -> Optional[type]:
    # Only types already imported here: a record never makes this process import a module.
    obj: Any = sys.modules.get(record.get("module", ""))
    for part in str(record.get("qualname", "")).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def rebuild_exception(record: dict[str, Any]) -> BaseException:
    """The recorded exception, rebuilt (see the module docstring), with the rank's traceback as cause."""
    kind = _exception_type(record)
    error: Optional[BaseException] = None
    if kind is not None:
        try:
            error = kind(*record["args"]) if record.get("args") is not None else kind(record["message"])
        except Exception:  # a constructor with other arguments: fall back to the message
            error = None
    if error is None:
        error = RuntimeError(f"{record.get('module')}.{record.get('qualname')}: {record.get('message')}")
    error.__cause__ = RankFailure(f"rank {record.get('rank')} failed first:\n{record.get('traceback', '')}")
    return error


def failure_file(run_dir: Optional[str], sequence: int) -> Optional[str]:
    """Where the ``sequence``-th launch of this process records its first failure."""
    return os.path.join(run_dir, f"failure-{sequence}.json") if run_dir else None


def report_rank_failure(path: Optional[str], rank: int, error: BaseException, script_rank: bool) -> None:
    """In a failing rank, before its teardown closes its connections (a peer's collective error comes after):
    record ``error`` as the run's first failure unless another rank's came first. A rank re-running the user's
    script (``script_rank``), other than rank 0, whose error is such a consequence (a collective that lost its
    peer) exits at once with status 1: the failing rank and rank 0 report it. A deliberate exit that every rank
    agreed on (``SystemExit``: code 16 of the rerun policy) is no failure."""
    if isinstance(error, SystemExit):
        return
    record_failure(path, rank, error)
    record = read_failure(path)
    if script_rank and rank != 0 and record is not None and record["rank"] != rank:
        sys.stderr.flush()
        os._exit(1)
