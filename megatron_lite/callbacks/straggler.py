"""StragglerReport: per-rank step-time statistics every N steps, the slowest ranks named (after
Megatron's straggler detector).

What is measured. A step's wall time is the same on every rank: the collectives make the fast ranks
wait for the slowest. What differs is the time a rank spent *working*: here the main thread's CPU time
during the step (``time.thread_time``), which does not advance while the thread waits in a collective
or sleeps in the data loader. On CPU ranks that is the compute time of the step; on GPU ranks it is the
host-side work (kernels are asynchronous, and a CUDA synchronisation may spin), a weaker signal. The
time between steps (data loading, callbacks) is reported too: it runs before any collective of the
next step, so a rank with slow input shows there.

Every ``interval`` steps the ranks all-gather a few numbers (one collective), rank 0 prints a table
sorted by work time with the slowest ``top_k`` ranks named and their ratio to the median, and logs
``straggler/work_ms_max``, ``straggler/work_ms_median``, ``straggler/work_max_over_median``,
``straggler/slowest_rank`` and ``straggler/step_ms`` (the mean wall time of a step).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

_FIELDS = ("work_ms", "work_ms_max", "step_ms", "between_ms")


class StragglerReport(pl.Callback):
    """Per-rank step-time statistics every ``interval`` steps; the slowest ranks named.

    Args:
        interval: optimizer steps between reports (one all-gather each).
        top_k: how many of the slowest ranks to name.
        console: print the report on rank 0 (it is logged, and kept in ``last_report``, either way).
    """

    def __init__(self, interval: int = 100, top_k: int = 3, console: bool = True) -> None:
        for name, value in (("interval", interval), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StragglerReport({name}={value!r}) must be a positive integer")
        self.interval, self.top_k, self.console = interval, top_k, console
        self.last_report: Optional[list[dict]] = None
        """The last report: per rank (sorted, slowest first) its mean and max work ms per step, mean
        step wall ms and mean ms between steps."""
        self._reset()
        self._last_end: Optional[float] = None

    def _reset(self) -> None:
        self._work: list[float] = []
        self._wall: list[float] = []
        self._between: list[float] = []

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset()
        self._last_end = None

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._between.append(1e3 * (now - self._last_end))
        self._start_wall, self._start_cpu = now, time.thread_time()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._work.append(1e3 * (time.thread_time() - self._start_cpu))
        self._wall.append(1e3 * (time.perf_counter() - self._start_wall))
        if trainer.global_step % self.interval == 0:
            self._report(trainer, pl_module)
            self._reset()
        self._last_end = time.perf_counter()

    def _report(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        mine = torch.tensor(
            [
                statistics.fmean(self._work),
                max(self._work),
                statistics.fmean(self._wall),
                statistics.fmean(self._between) if self._between else 0.0,
            ],
            dtype=torch.float64,
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = trainer.strategy.root_device
            gathered = [
                torch.empty(len(_FIELDS), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())
            ]
            dist.all_gather(gathered, mine.to(device))
            rows = [g.cpu() for g in gathered]
        else:
            rows = [mine]
        report = sorted(
            ({"rank": r, **{f: float(v) for f, v in zip(_FIELDS, row.tolist())}} for r, row in enumerate(rows)),
            key=lambda e: -e["work_ms"],
        )
        self.last_report = report
        median = statistics.median(e["work_ms"] for e in report)
        ratio = report[0]["work_ms"] / median if median > 0 else 1.0
        pl_module.log_dict(
            {
                "straggler/work_ms_max": report[0]["work_ms"],
                "straggler/work_ms_median": median,
                "straggler/work_max_over_median": ratio,
                "straggler/slowest_rank": float(report[0]["rank"]),
                "straggler/step_ms": statistics.fmean(e["step_ms"] for e in report),
            },
            rank_zero_only=True,
        )
        if self.console and trainer.global_rank == 0:
            rank_zero_info(self.format(report, trainer.global_step, len(self._work)))

    def format(self, report: list[dict], step: int, steps: int) -> str:
        median = statistics.median(e["work_ms"] for e in report)
        slowest = (
            ", ".join(
                f"rank {e['rank']} ({e['work_ms']:.1f} ms, {e['work_ms'] / median:.2f}x the median)"
                for e in report[: self.top_k]
            )
            if median > 0
            else "none"
        )
        lines = [
            f"straggler report, {steps} steps up to step {step}: slowest ranks by work time: {slowest}",
            f"  {'rank':>5} {'work ms/step':>13} {'work ms max':>12} {'step ms':>9} {'between ms':>11}",
        ]
        lines += [
            f"  {e['rank']:>5} {e['work_ms']:>13.1f} {e['work_ms_max']:>12.1f} {e['step_ms']:>9.1f} "
            f"{e['between_ms']:>11.1f}"
            for e in report
        ]
        return "\n".join(lines)
