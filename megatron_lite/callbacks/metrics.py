"""MegatronMetrics: throughput, MFU, memory, consumed samples, perplexity and Megatron's timers,
logged once per optimizer step interval, plus Megatron's one-line console log.

Steps. GPTModule takes one optimizer step per Lightning batch, so every ``on_train_batch_end`` is
one optimizer step and the metrics are logged through ``pl_module.log`` from that hook: they land in
the same row, at the same step, as the module's ``train/loss`` (Lightning's logged step, the number
of optimizer steps taken *before* this one; ``trainer.global_step`` counts this one too). Lightning
writes only every ``log_every_n_steps`` and loggers write only on global rank 0, so nothing is
written twice; ``rank_zero_only=True`` skips a pointless cross-rank sync of values every rank
already has.

Timing. The time of a step is the wall clock between consecutive ``on_train_batch_end`` calls
(Megatron's ``interval-time``), averaged over the steps since the last log. The first step of a
``fit`` is warm-up and never counted; validation inside the epoch is paused out.

Console. The iteration line and the timer block go through the progress bar's ``print`` (tqdm's
``write``: the bar is cleared, the text printed, the bar redrawn below it), so they never split a bar
line; without an enabled bar, through ``print``. The timer block is 6+ lines, so it comes less often
than the iteration line (every ``timers_interval`` steps, by default 10 log intervals): printed at
every log interval, as Megatron does with ``--timing-log-level`` > 0, it buries the iteration lines
and the bar. Loggers still get ``timers/<name>`` at every log interval. Warnings are raised in
``setup``, before any bar is drawn: a warning goes to stderr and would land in the middle of one.
Rich's bar, Lightning's default when ``rich`` is installed, is titled "Epoch N" in a run bounded by
``max_steps`` (it writes "Epoch 0/-2" there: see :func:`describe_epoch_without_limit`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from megatron_lite.callbacks.energy import EnergyMeter
from megatron_lite.callbacks.memory_report import flops_per_step
from megatron_lite.callbacks.peak_flops import (
    cuda_tf32_enabled,
    known_gpu_peak_tflops,
    measure_matmul_tflops,
    precision_dtype,
)
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.parallel.geometry import declared_geometry
from megatron_lite.core.timers import LogOption, TimerReport, Timers

# Megatron's timer names and levels (0: always on; 1: per-step phases; 2: finest).
INTERVAL_TIMER = ("interval-time", 0)
FORWARD_BACKWARD_TIMER = ("forward-backward", 1)
OPTIMIZER_TIMER = ("optimizer", 1)
BATCH_GENERATOR_TIMER = ("batch-generator", 2)

GIB = 2**30


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """Peak memory of this process in GiB: CUDA ``max_memory_allocated`` on a GPU, else the peak
    resident set size (None where the ``resource`` module does not exist, i.e. Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB


class MegatronMetrics(pl.Callback):
    """Megatron's training metrics for a Lightning run.

    Logs ``train/consumed_samples``, ``train/tokens_per_sec`` (the whole job's tokens per second),
    ``train/tflops_per_device``, ``train/mfu``, ``train/mem_peak_gib`` and ``timers/<name>`` (max
    ms per step across ranks) at every logging step, and ``val/perplexity`` (``exp(val/loss)``)
    after each validation. FLOPs come from :func:`training_flops_per_step` of the module's
    ``config`` (a :class:`GPTConfig`) and the datamodule's batch ``geometry`` (global batch, seq_length), with
    what one sample costs the module's objective (``objective_cost``: a DPO pair is two sequences and the
    reference model's forward over both, a GRPO prompt ``group_size`` sequences and their extra forwards). For a
    Mixture-of-Experts model they count the *active* parameters: a token's top-k experts, not all of them.

    Args:
        peak_tflops_per_device: dense peak TFLOP/s of one device for MFU. None: the data-sheet peak
            of a known GPU for the training precision, else (CPU, unknown GPU) a measured matmul peak.
        timing_log_level: Megatron's ``--timing-log-level``: 0 times only whole steps, 1 adds
            forward-backward and optimizer, 2 adds batch-generator (data loading and the loop around it).
        timing_log_option: ``"minmax"``, ``"max"`` or ``"all"`` ranks, for the console timer block.
        console: print Megatron's one-line iteration log (and the timer block) on global rank 0.
        log_interval: steps between measurements: the console's iteration line and the logged metrics
            (Megatron's ``--log-interval``). None: the Trainer's ``log_every_n_steps``. The loggers
            write a value only at a step where Lightning writes too (a multiple of ``log_every_n_steps``).
        timers_interval: steps between the console's timer blocks, a multiple of ``log_interval``; the
            block holds each timer's per-step (min, max) over those steps. None: 10 x ``log_interval``;
            0: never on the console (loggers still get ``timers/<name>``).

    ``timers`` is the :class:`Timers` of the run (bound to the training device at setup): a module
    may time its own phases with it.
    """

    def __init__(
        self,
        peak_tflops_per_device: Optional[float] = None,
        timing_log_level: int = 1,
        timing_log_option: LogOption = "minmax",
        console: bool = True,
        log_interval: Optional[int] = None,
        timers_interval: Optional[int] = None,
    ) -> None:
        super().__init__()
        if peak_tflops_per_device is not None and not (
            isinstance(peak_tflops_per_device, (int, float))
            and math.isfinite(peak_tflops_per_device)
            and peak_tflops_per_device > 0
        ):
            raise ValueError(
                f"peak_tflops_per_device must be a positive number of TFLOP/s or None (look it up "
                f"or measure it), got {peak_tflops_per_device!r}"
            )
        if log_interval is not None and not _is_int(log_interval, minimum=1):
            raise ValueError(
                f"log_interval must be a positive number of steps or None (the Trainer's "
                f"log_every_n_steps), got {log_interval!r}"
            )
        if timers_interval is not None and not _is_int(timers_interval, minimum=0):
            raise ValueError(
                f"timers_interval must be a number of steps >= 0 (0: no timer block on the console) or "
                f"None (10 x log_interval), got {timers_interval!r}"
            )
        self.peak_tflops_per_device = peak_tflops_per_device
        self.timing_log_level = timing_log_level
        self.timing_log_option = timing_log_option
        self.console = console
        self.log_interval = log_interval
        self.timers_interval = timers_interval
        self._energy: Optional[EnergyMeter] = None  # made in setup, for one fit
        self.timers = Timers(timing_log_level, timing_log_option)  # validates both
        self._measured_peaks: dict[tuple, float] = {}  # (device, dtype, threads) -> TFLOP/s
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._peak_tflops: Optional[float] = None
        self._flops_per_step: Optional[float] = None
        self._global_batch_size: Optional[int] = None
        self._seq_length: Optional[int] = None
        self._timed_steps = 0  # steps in the interval timer since the last log
        self._timed_samples = 0  # global samples of those steps (varies under batch-size ramp-up)
        self._flops_per_sample: Optional[float] = None
        self._dp_size = 1
        self._interval_joules = 0.0  # energy of the timed steps since the last log (validation excluded)
        self._steps_since_log = 0  # steps since the last log, warm-up included (for the phase timers)
        self._paused: list = []  # timers stopped for a validation inside training
        # per-rank ms summed over the steps since the last console timer block, per timer name
        self._block_ms: dict[str, list[float]] = {}
        self._block_steps = 0

    @property
    def flops_per_sample(self) -> Optional[float]:
        """Model FLOPs of one sample of the run's data, what TFLOP/s and MFU count (the objective's cost of a
        sample, see ``objective_cost``); None before ``fit`` starts, or without a GPTConfig and batch geometry."""
        return self._flops_per_sample

    # --- set-up ---------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.timers = Timers(self.timing_log_level, self.timing_log_option, device=trainer.strategy.root_device)
        if stage != "fit":
            return
        log_every, timers_every = self._intervals(trainer)
        if timers_every and log_every and timers_every % log_every:
            raise ValueError(
                f"MegatronMetrics(timers_interval={timers_every}) must be a multiple of the log interval "
                f"({log_every}): timers are gathered at log steps only; set timers_interval="
                f"{max(1, round(timers_every / log_every)) * log_every}."
            )
        # Here, before any progress bar is drawn: a warning raised during training lands inside a bar line.
        self._energy = EnergyMeter(trainer.strategy.root_device)
        if not self._energy.available:
            rank_zero_warn(f"MegatronMetrics logs no train/energy_per_step_j: {self._energy.reason}")
        datamodule = getattr(trainer, "datamodule", None)
        if not (isinstance(getattr(pl_module, "config", None), GPTConfig) and declared_geometry(datamodule)):
            rank_zero_warn(
                "MegatronMetrics logs no FLOPs or MFU: they need a module with a GPTConfig `config` and a "
                "datamodule with a batch `geometry` (a DataGeometry: global_batch_size, seq_length; e.g. "
                "GPTModule + MockGPTDataModule)."
            )

    def _intervals(self, trainer: "pl.Trainer") -> tuple[int, int]:
        """(log interval, console timer-block interval) in steps; 0 means never."""
        log_every = self.log_interval if self.log_interval is not None else trainer.log_every_n_steps
        timers_every = self.timers_interval if self.timers_interval is not None else 10 * log_every
        return log_every, timers_every

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset_run_state()
        datamodule = getattr(trainer, "datamodule", None)
        geometry = declared_geometry(datamodule)
        if geometry is not None:
            self._global_batch_size, self._seq_length = geometry.global_batch_size, geometry.seq_length
        if isinstance(getattr(pl_module, "config", None), GPTConfig) and geometry is not None:
            layout = getattr(trainer.strategy, "parallel_layout", None)
            tp = layout.tp_size if layout is not None else 1  # decides the vocabulary padding
            self._flops_per_step = flops_per_step(pl_module, datamodule, geometry, tp)
            self._flops_per_sample = self._flops_per_step / self._global_batch_size  # linear in the batch
            self._dp_size = layout.dp_size if layout is not None else 1
            self._peak_tflops = self._resolve_peak(trainer)

    def _resolve_peak(self, trainer: "pl.Trainer") -> float:
        if self.peak_tflops_per_device is not None:
            return float(self.peak_tflops_per_device)
        device = trainer.strategy.root_device
        dtype = precision_dtype(trainer.precision)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            known = known_gpu_peak_tflops(name, dtype, tf32=cuda_tf32_enabled())
            if known is not None:
                return known
            rank_zero_warn(
                f"no data-sheet peak for {name!r} in {dtype}: MFU uses a measured matmul peak; pass "
                f"MegatronMetrics(peak_tflops_per_device=...) for the real one."
            )
        key = (str(device), dtype, torch.get_num_threads())
        if key not in self._measured_peaks:
            self._measured_peaks[key] = measure_matmul_tflops(device, dtype)
        return self._measured_peaks[key]

    # --- timing around Lightning's hooks ----------------------------------------------------
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        batch_generator = self.timers(*BATCH_GENERATOR_TIMER)
        if not batch_generator.started:
            batch_generator.start()
        if self.console:
            describe_epoch_without_limit(trainer)

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self.console:  # again: a bar whose epoch start ran after ours, or whose task began mid-epoch
            describe_epoch_without_limit(trainer)
        batch_generator = self.timers(*BATCH_GENERATOR_TIMER)
        if batch_generator.started:
            batch_generator.stop()
        self.timers(*FORWARD_BACKWARD_TIMER).start()

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        # Fires inside the module's optimizer.step() (manual optimization too), after gradient
        # reduction and clipping: those count as forward-backward, like Megatron's grad sync does.
        forward_backward = self.timers(*FORWARD_BACKWARD_TIMER)
        if forward_backward.started:
            forward_backward.stop()
            self.timers(*OPTIMIZER_TIMER).start()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for phase in (OPTIMIZER_TIMER, FORWARD_BACKWARD_TIMER):
            timer = self.timers(*phase)
            if timer.started:
                timer.stop()
        interval = self.timers(*INTERVAL_TIMER)
        if interval.started:
            self._timed_steps += 1
            self._timed_samples += _batch_samples(batch) * self._dp_size
        else:
            interval.start()  # the first step is warm-up: the interval starts at its end
            self._start_energy(trainer)
        self._steps_since_log += 1
        every, timers_every = self._intervals(trainer)
        periodic = every > 0 and trainer.global_step % every == 0
        if periodic or (every > 0 and trainer.should_stop):
            timer_block = periodic and timers_every > 0 and trainer.global_step % timers_every == 0
            self._log_interval(trainer, pl_module, gather_timers=periodic, timer_block=timer_block)
        self.timers(*BATCH_GENERATOR_TIMER).start()

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        batch_generator = self.timers(*BATCH_GENERATOR_TIMER)
        if batch_generator.started:
            batch_generator.stop()  # the last fetch of the epoch, which found no batch

    def _start_energy(self, trainer: "pl.Trainer") -> None:
        if self._energy is None:  # fit without setup (never under a Trainer): measure, without a warning
            self._energy = EnergyMeter(trainer.strategy.root_device)
        if self._energy.available:
            self._energy.joules_since_last()  # a new interval: drop what came before
        self._interval_joules = 0.0

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.training or trainer.state.fn != "fit":
            return
        if self._energy is not None and self._energy.available:
            self._interval_joules += self._energy.joules_since_last()
        names = (INTERVAL_TIMER, BATCH_GENERATOR_TIMER)
        self._paused = [self.timers(*n) for n in names if self.timers(*n).started]
        for timer in self._paused:
            timer.stop()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._paused and self._energy is not None and self._energy.available:
            self._energy.joules_since_last()  # validation's energy is not the steps'
        for timer in self._paused:
            timer.start()
        self._paused = []

    # --- logging -------------------------------------------------------------------------
    def _log_interval(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", gather_timers: bool, timer_block: bool = False
    ) -> None:
        metrics: dict[str, float] = {}
        if self._global_batch_size:
            datamodule = getattr(trainer, "datamodule", None)
            consumed_after = getattr(datamodule, "consumed_samples_after", None)  # knows the batch-size ramp-up
            consumed = (
                consumed_after(trainer.global_step)
                if callable(consumed_after)
                else trainer.global_step * self._global_batch_size
            )
            metrics["train/consumed_samples"] = float(consumed)
        ms_per_step = None
        if self._timed_steps > 0:
            seconds_total = self.timers(*INTERVAL_TIMER).elapsed(reset=True)
            ms_per_step = seconds_total * 1000.0 / self._timed_steps
            if self._timed_samples and self._seq_length:
                metrics["train/tokens_per_sec"] = self._timed_samples * self._seq_length / seconds_total
            if self._flops_per_sample is not None and self._timed_samples:
                tflops = self._flops_per_sample * self._timed_samples / seconds_total / trainer.world_size / 1e12
                metrics["train/tflops_per_device"] = tflops
                if self._peak_tflops:
                    metrics["train/mfu"] = tflops / self._peak_tflops
            if self._energy is not None and self._energy.available:
                joules = self._interval_joules + self._energy.joules_since_last()
                metrics["train/energy_per_step_j"] = joules / self._timed_steps
                self._interval_joules = 0.0
            self._timed_steps = 0
            self._timed_samples = 0
        memory = peak_memory_gib(trainer.strategy.root_device)
        if memory is not None:
            metrics["train/mem_peak_gib"] = memory
        timer_text = ""
        phase_names = [n for n in self.timers.names if n != INTERVAL_TIMER[0]]
        if gather_timers and phase_names:
            # A collective: every rank reaches here at the same global_step.
            steps = max(self._steps_since_log, 1)
            report = self.timers.log(phase_names, normalizer=steps)
            metrics.update(report.metrics())
            self._add_to_timer_block(report, steps)
        if timer_block:
            timer_text = self._take_timer_block()
        self._steps_since_log = 0
        for name, value in metrics.items():
            pl_module.log(
                name, torch.tensor(value, dtype=torch.float64), on_step=True, on_epoch=False, rank_zero_only=True
            )
        if self.console and trainer.is_global_zero:
            self._print(trainer, iteration_line(trainer, metrics, ms_per_step, self._global_batch_size))
            if timer_text:
                self._print(trainer, timer_text)

    def _add_to_timer_block(self, report: TimerReport, steps: int) -> None:
        """Add a log interval's per-step times (``steps`` steps) to the next console timer block."""
        for i, name in enumerate(report.names):
            sums = self._block_ms.setdefault(name, [0.0] * len(report.per_rank_ms))
            for rank, row in enumerate(report.per_rank_ms):
                sums[rank] += row[i] * steps
        self._block_steps += steps

    def _take_timer_block(self) -> str:
        """Megatron's timer block over the steps since the last one (per-step ms), and start a new one."""
        if not self._block_steps:
            return ""
        names = list(self._block_ms)
        per_rank = [
            [self._block_ms[n][rank] / self._block_steps for n in names]
            for rank in range(len(next(iter(self._block_ms.values()))))
        ]
        self._block_ms, self._block_steps = {}, 0
        return TimerReport(names=names, per_rank_ms=per_rank, log_option=self.timing_log_option).text

    @staticmethod
    def _print(trainer: "pl.Trainer", text: str) -> None:
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            # Lightning's bars print above themselves: TQDMProgressBar through tqdm.write (clear the bar,
            # write, redraw it below), RichProgressBar through its live console's stdout redirection.
            bar.print(text)
        else:
            # No bar, or a disabled one (refresh_rate=0), whose print() finds no active bar and drops the text.
            print(text, flush=True)

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._log_perplexity(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._log_perplexity(trainer, pl_module, "test")

    @staticmethod
    def _log_perplexity(trainer: "pl.Trainer", pl_module: "pl.LightningModule", prefix: str) -> None:
        """``exp`` of the epoch's mean loss per token (the module's ``<prefix>/loss``, synced across
        ranks, so every rank logs the same value; ``sync_dist`` then averages equal numbers, which
        keeps the metric usable as a ``monitor``)."""
        if trainer.sanity_checking or not getattr(pl_module, "loss_is_token_nll", True):
            return  # exp of a preference or policy loss is no perplexity
        loss = trainer.callback_metrics.get(f"{prefix}/loss")
        if loss is None:
            return
        pl_module.log(
            f"{prefix}/perplexity", torch.exp(loss.detach().double()), on_step=False, on_epoch=True, sync_dist=True
        )


def iteration_line(
    trainer: "pl.Trainer", metrics: dict, ms_per_step: Optional[float], global_batch_size: Optional[int]
) -> str:
    """Megatron's console log of an interval, in Megatron's order: iteration N/M, consumed samples,
    ms per iteration, TFLOP/s per device, learning rate, global batch size, loss, loss scale, grad
    norm, skipped iterations. The module's values (``train/lr``, ``train/loss``, ``train/loss_scale``,
    ``train/grad_norm``, ``train/skipped_steps``) appear when it logged them. N counts the optimizer
    steps done, like Megatron's ``iteration``."""
    logged = trainer.callback_metrics

    def module_value(key: str, label: str, fmt: str) -> Optional[str]:
        if key not in logged:
            return None
        value = float(logged[key])
        return f"{label}: {format(value, fmt) if math.isfinite(value) else value}"

    total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
    consumed = metrics.get("train/consumed_samples")
    tflops = metrics.get("train/tflops_per_device")
    parts = [
        f"iteration {trainer.global_step:>8d}/{total:>8}",
        f"consumed samples: {int(consumed):>12d}" if consumed is not None else None,
        f"elapsed time per iteration (ms): {ms_per_step:.1f}" if ms_per_step is not None else None,
        f"throughput per device (TFLOP/s/device): {tflops:.3f}" if tflops is not None else None,
        module_value("train/lr", "learning rate", ".6E"),
        f"global batch size: {global_batch_size:>5d}" if global_batch_size else None,
        module_value("train/loss", "loss", ".6E"),
        module_value("train/loss_scale", "loss scale", ".1f"),
        module_value("train/grad_norm", "grad norm", ".3f"),
        module_value("train/skipped_steps", "skipped iterations", ".0f"),
    ]
    return " | ".join(p for p in parts if p is not None) + " |"


def describe_epoch_without_limit(trainer: "pl.Trainer") -> None:
    """Title the train bar of Lightning's ``RichProgressBar`` "Epoch N" when the run has no epoch limit
    (``max_epochs=-1``: a run bounded by ``max_steps``, what Lightning sets when only ``max_steps`` is given). The
    bar writes "Epoch N/{max_epochs - 1}", so "Epoch 0/-2" there (fixed in Lightning 2.7, #21924); its count
    already runs over the run's steps. TQDM's bar says "Epoch N" and needs nothing."""
    bar = trainer.progress_bar_callback
    if trainer.max_epochs != -1 or not isinstance(bar, RichProgressBar) or not bar.is_enabled:
        return
    if bar.progress is None or bar.train_progress_bar_id is None:
        return
    title = f"Epoch {trainer.current_epoch}"
    title = f"{title:{len(bar.validation_description)}}"  # as wide as "Validation", as Lightning pads it
    style = bar.theme.description
    description = f"[{style}]{title}" if style else title
    if bar.progress.tasks[bar.train_progress_bar_id].description != description:
        bar.progress.update(bar.train_progress_bar_id, description=description)
        bar.refresh()  # redraw now: the bar drew its own title as it started the epoch


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _batch_samples(batch: Any) -> int:
    """Samples this rank received in one step (the first dimension of the batch's first tensor)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    return int(batch.shape[0]) if torch.is_tensor(batch) and batch.ndim else 0
