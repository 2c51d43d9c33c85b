"""A hang watchdog for one rank: a heartbeat, and when it stops for longer than a timeout, every
thread's Python stack to the log (faulthandler) and a non-zero exit so that the launcher can restart
the job -- never waiting forever. Plain Python (no Lightning; the callback ``HangWatchdog`` beats it).

Every rank's stacks. When one rank is stuck (a sleep, a deadlock, a dead peer), the others block in
that step's collectives, so their heartbeats stop too and their own watchdogs fire at about the same
time. Two things make sure each rank's stacks reach the log before anyone's connections close and
turn the blocked collectives into errors: a rank whose watchdog fires first writes an *alarm* file
(named after the run, in a directory the ranks share) that makes every other rank's watchdog dump at
once, and it lingers ``linger_s`` seconds before exiting. A rank wedged in C code that holds the GIL
cannot run this thread; for that, faulthandler's own C-level timer (``dump_traceback_later``) is
armed at every beat as a backstop, a little after the thread's deadline (it exits with code 1).

Collective timeouts are a second lever: ``init_process_group(timeout=...)`` (MegatronStrategy's
``timeout``) makes a gloo collective raise after that long (NCCL needs its async error handling on).
Only the default group gets it: torch gives groups made later (the DeviceMesh's) the 30-minute
default, so the watchdog is what bounds a hang in a tensor- or pipeline-parallel collective.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

WATCHDOG_EXIT_CODE = 124
"""Exit code of a rank whose watchdog fired (as GNU ``timeout``: the command timed out)."""

_BACKSTOP_MARGIN_S = 10.0


class Watchdog:
    """Fires when :meth:`beat` was not called for ``timeout_s`` seconds (per-beat overrides allowed).

    Args:
        timeout_s: seconds without a heartbeat before firing.
        rank: this process's global rank (for the messages and the stack file's name).
        dump_dir: a directory every rank can write (shared): ``rank<r>.txt`` gets this rank's stacks,
            and the alarm file that makes the other ranks dump goes there. None: stderr only, no alarm.
        run_id: names the alarm file, so that an old run's alarm never fires a new run (the same on every rank).
        linger_s: seconds between dumping and exiting, for the other ranks to dump.
        exit_code: the process's exit code when it fires.
        poll_s: how often the thread looks at the clock and the alarm.
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int = 0,
        dump_dir: Optional[str] = None,
        run_id: str = "run",
        linger_s: float = 5.0,
        exit_code: int = WATCHDOG_EXIT_CODE,
        poll_s: Optional[float] = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the watchdog's timeout must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s, self.rank, self.run_id = float(timeout_s), rank, run_id
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.linger_s, self.exit_code = float(linger_s), int(exit_code)
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._deadline = time.monotonic() + self.timeout_s
        self._where = "starting"
        self._armed_for = self.timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def alarm_file(self) -> Optional[Path]:
        return self.dump_dir / f"ALARM-{self.run_id}" if self.dump_dir is not None else None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"megatron-lite-watchdog-rank{self.rank}", daemon=True)
        self.beat("starting")
        self._thread.start()

    def beat(self, where: str, timeout_s: Optional[float] = None) -> None:
        """Progress: the next deadline is ``timeout_s`` (default: the watchdog's) from now; ``where`` says
        what the rank is about to do (it is named if the deadline passes). Nothing before :meth:`start`
        or after :meth:`stop`."""
        if self._thread is None:
            return
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            self._deadline, self._where, self._armed_for = time.monotonic() + timeout, where, timeout
        # the C-level backstop for a rank that never releases the GIL (process-wide: one per process)
        faulthandler.dump_traceback_later(timeout + self.linger_s + _BACKSTOP_MARGIN_S, exit=True)

    def stop(self) -> None:
        """Disarm (end of training, or an exception that ends the run)."""
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                overdue, where, armed = time.monotonic() - self._deadline, self._where, self._armed_for
            if overdue >= 0:
                self._fire(f"no progress for {armed + overdue:.0f} s (timeout {armed:g} s) while {where}")
                return
            alarm = self.alarm_file
            if alarm is not None and alarm.exists():
                peer = alarm.read_text().strip() or "another rank"
                self._fire(f"{peer}'s watchdog fired; this rank is {where}")
                return

    def _fire(self, reason: str) -> None:
        header = (
            f"megatron-lite watchdog: rank {self.rank} (pid {os.getpid()}): {reason}. Python stacks of every "
            f"thread follow; exiting with code {self.exit_code} so that the launcher can restart the job.\n"
        )
        faulthandler.cancel_dump_traceback_later()
        self._dump(sys.stderr, header)
        if self.dump_dir is not None:
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                with open(self.dump_dir / f"rank{self.rank}.txt", "w") as f:
                    self._dump(f, header)
                alarm = self.alarm_file
                if alarm is not None and not alarm.exists():
                    tmp = alarm.with_name(f".{alarm.name}.rank{self.rank}")
                    tmp.write_text(f"rank {self.rank}")
                    tmp.replace(alarm)
            except OSError as error:
                sys.stderr.write(
                    f"megatron-lite watchdog: rank {self.rank}: could not write to {self.dump_dir}: {error}\n"
                )
        time.sleep(self.linger_s)  # the other ranks dump before this one's connections close
        sys.stderr.flush()
        os._exit(self.exit_code)

    @staticmethod
    def _dump(stream, header: str) -> None:
        stream.write(header)
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
