"""Megatron-style named timers with levels, and their min/max across ranks.

Semantics follow Megatron-LM's ``megatron/core/timers.py``: ``timers(name, log_level)`` returns a
timer with ``start(barrier)`` / ``stop(barrier)`` / ``elapsed(reset)``; a timer whose level is above
the configured one is a no-op (so timing calls can stay in the code at no cost); ``log`` gathers
every rank's elapsed times and reports ``(min, max)`` (or the max, or every rank) in milliseconds.

Differences, on purpose: no globals (a :class:`Timers` object is passed to whoever times), the CUDA
synchronization happens only when the timed device is CUDA (so CPU runs never touch CUDA), the
gather runs over any process group and works on gloo, and ``log`` returns a :class:`TimerReport`
(its text *and* the numbers, for loggers) instead of printing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist

LogOption = Literal["max", "minmax", "all"]
LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2


def _synchronize(device: Optional[torch.device]) -> None:
    """Wait for queued CUDA kernels, so that a wall-clock reading covers them; nothing on other devices."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class DummyTimer:
    """What ``Timers`` hands out for a timer above the configured log level: every call does nothing."""

    name = "dummy"

    def start(self, barrier: bool = False) -> None:
        """No-op."""

    def stop(self, barrier: bool = False) -> None:
        """No-op."""

    def reset(self) -> None:
        """No-op."""

    @property
    def started(self) -> bool:
        """Never running."""
        return False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """A disabled timer has measured nothing; reading it is a bug in the caller."""
        raise RuntimeError(
            "this timer is disabled by the log level (a DummyTimer has no elapsed time); "
            "raise Timers(log_level=...) to the timer's level to measure it"
        )

    def active_time(self) -> float:
        """A disabled timer has measured nothing (see :meth:`elapsed`)."""
        return self.elapsed()


class Timer:
    """Accumulating wall-clock timer (seconds)."""

    def __init__(self, name: str, device: Optional[torch.device] = None, barrier_group=None) -> None:
        self.name = name
        self._device = device
        self._barrier_group = barrier_group
        self._elapsed = 0.0  # since the last reset
        self._active_time = 0.0  # since construction, never reset
        self._started = False
        self._start_time = time.perf_counter()

    @property
    def started(self) -> bool:
        """Whether the timer is running."""
        return self._started

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        """Start timing (after a barrier over the timers' group if ``barrier``)."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started; stop() it first")
        if barrier:
            self._barrier()
        _synchronize(self._device)
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the elapsed time."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started; start() it first")
        if barrier:
            self._barrier()
        _synchronize(self._device)
        interval = time.perf_counter() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self) -> None:
        """Zero the elapsed time and stop the timer."""
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset, including a running interval (the timer keeps running)."""
        was_running = self._started
        if was_running:
            self.stop(barrier=barrier)
        total = self._elapsed
        if reset:
            self.reset()
        if was_running:
            self.start(barrier=barrier)
        return total

    def active_time(self) -> float:
        """Seconds accumulated over the timer's whole life (never reset)."""
        return self._active_time


@dataclass
class TimerReport:
    """Elapsed times of some timers on every rank of a group, in milliseconds (divided by a normalizer)."""

    names: list
    """Timer names, in the order of the columns of ``per_rank_ms``."""
    per_rank_ms: list
    """``per_rank_ms[rank][i]``: milliseconds of timer ``names[i]`` on that rank (0.0: not timed there)."""
    log_option: LogOption = "minmax"
    """How :attr:`text` presents the times: max only, (min, max), or every rank."""
    min_max_ms: dict = field(init=False)
    """``{name: (min, max)}`` over the ranks that timed ``name``; names no rank timed are left out."""

    def __post_init__(self) -> None:
        self.min_max_ms = {}
        for i, name in enumerate(self.names):
            # Megatron's rule: a zero means "this rank did not run this timer", not "it took no time".
            timed = [row[i] for row in self.per_rank_ms if row[i] > 0.0]
            if timed:
                self.min_max_ms[name] = (min(timed), max(timed))

    @property
    def text(self) -> str:
        """Megatron's log block, e.g. ``(min, max) time across ranks (ms):`` then one line per timer;
        empty when no timer was timed."""
        if self.log_option == "all":
            lines = []
            for i, name in enumerate(self.names):
                ranks = [(r, row[i]) for r, row in enumerate(self.per_rank_ms) if row[i] > 0.0]
                if ranks:
                    lines.append(f"  {name}:")
                    lines += [f"     rank {r:2d}: {ms:.2f}" for r, ms in ranks]
            return "\n".join(["times across ranks (ms):", *lines]) if lines else ""
        if not self.min_max_ms:
            return ""
        max_only = self.log_option == "max"
        lines = ["max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"]
        for name, (low, high) in self.min_max_ms.items():
            label = (name + " ").ljust(48, ".")
            lines.append(f"    {label}: {high:.2f}" if max_only else f"    {label}: ({low:.2f}, {high:.2f})")
        return "\n".join(lines)

    def metrics(self, prefix: str = "timers/") -> dict:
        """``{prefix + name: max ms}`` for loggers (Megatron writes the max across ranks)."""
        return {f"{prefix}{name}": high for name, (_, high) in self.min_max_ms.items()}

    def __str__(self) -> str:
        return self.text


class Timers:
    """A registry of named :class:`Timer` objects with Megatron's log levels (0: coarse ... 2: finest).

    Args:
        log_level: timers with a higher level are :class:`DummyTimer` no-ops.
        log_option: ``"minmax"`` (Megatron's default), ``"max"`` or ``"all"`` (every rank): how
            :meth:`log` presents the times.
        device: the device whose queued work a reading must include: CUDA is synchronized before
            every reading; None times host work only.
        barrier_group: process group of ``start(barrier=True)`` / ``stop(barrier=True)``; None is the world.
    """

    def __init__(
        self,
        log_level: int = 0,
        log_option: LogOption = "minmax",
        device: Union[torch.device, str, None] = None,
        barrier_group=None,
    ) -> None:
        if isinstance(log_level, bool) or not isinstance(log_level, int) or not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"log_level must be an integer in 0..{MAX_LOG_LEVEL}, got {log_level!r}")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"log_option must be one of {LOG_OPTIONS}, got {log_option!r}")
        self.log_level = log_level
        self.log_option: LogOption = log_option
        self.device = torch.device(device) if device is not None else None
        self._barrier_group = barrier_group
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None) -> Union[Timer, DummyTimer]:
        """The timer ``name`` (created on first use, at ``log_level``, default the finest level)."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created at log level {self._log_levels[name]}, "
                    f"asked for level {log_level}; use one level per timer name"
                )
            return self._timers[name]
        level = MAX_LOG_LEVEL if log_level is None else log_level
        if not 0 <= level <= MAX_LOG_LEVEL:
            raise ValueError(f"timer log_level must be in 0..{MAX_LOG_LEVEL}, got {level!r}")
        if level > self.log_level:
            return self._dummy
        self._timers[name] = Timer(name, self.device, self._barrier_group)
        self._log_levels[name] = level
        return self._timers[name]

    @property
    def names(self) -> list:
        """Names of the enabled timers, in creation order."""
        return list(self._timers)

    def elapsed_ms(self, names: Iterable[str], reset: bool = True) -> list:
        """This rank's milliseconds for each of ``names`` (0.0 for a name that is not an enabled timer)."""
        return [self._timers[n].elapsed(reset=reset) * 1000.0 if n in self._timers else 0.0 for n in names]

    def log(
        self,
        names: Optional[Iterable[str]] = None,
        normalizer: float = 1.0,
        group=None,
        reset: bool = True,
        barrier: bool = False,
    ) -> TimerReport:
        """Gather the elapsed times of ``names`` (default: every enabled timer) from every rank of
        ``group`` (None: the world; without a process group, this rank alone), divided by
        ``normalizer`` (e.g. iterations per interval), in ms. A collective: every rank of ``group``
        must call it with the same names. ``str(report)`` is Megatron's log text; ``report.metrics()``
        is for loggers."""
        if not normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0 (e.g. the number of iterations timed), got {normalizer!r}")
        names = list(self._timers if names is None else names)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and barrier:
            dist.barrier(group=group)
        local = torch.tensor(self.elapsed_ms(names, reset=reset), dtype=torch.float64)
        if distributed:
            # NCCL gathers CUDA tensors only; gloo (and others) gather CPU tensors.
            device = torch.device("cpu")
            if dist.get_backend(group) == "nccl":
                device = self.device if self.device is not None else torch.device("cuda", torch.cuda.current_device())
            local = local.to(device)
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            per_rank = torch.stack(gathered).cpu()
        else:
            per_rank = local.unsqueeze(0)
        per_rank_ms = (per_rank / normalizer).tolist()
        return TimerReport(names=names, per_rank_ms=per_rank_ms, log_option=self.log_option)


@contextlib.contextmanager
def timed(timers: Optional["Timers"], name: str, log_level: int = 1) -> Iterator[None]:
    """Time the block with ``timers(name, log_level)``; nothing when ``timers`` is None."""
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    timer.start()
    try:
        yield
    finally:
        timer.stop()
