"""GracefulExit: save a checkpoint and stop cleanly on a signal (SIGTERM before a preemption), after a
number of steps (Megatron's ``exit_interval``) or a wall-clock budget (``exit_duration_in_mins``).

Agreement. A signal may reach one rank only (SLURM and Kubernetes signal every process, ``kill`` one),
and wall clocks differ between ranks, so at every step boundary the ranks all-reduce (MAX) one small
tensor of flags -- [signal received, budget spent] -- and all stop after the same step. The save is
``trainer.save_checkpoint`` into the checkpoint callback's directory under ModelCheckpoint's *last*
name (``last.ckpt``), which is what ``trainer.fit(..., ckpt_path="last")`` resumes; then the fit ends
the normal way (``trainer.should_stop``), so loggers flush, a forked run hands its model back, and a
script that ends after ``fit`` exits with code 0 on every rank. A second signal ends the process at
once (the signal's default action).

Lightning's own SIGTERM handling (its ``_SignalConnector``) broadcasts from inside the signal handler
-- a collective that the other ranks never match when the signal reaches one rank -- and follows rank
0's flag only. So this callback replaces the handlers of its signals once Lightning has installed its
own (``on_train_start``), and leaves restoring the pre-fit handlers to Lightning's teardown.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

SignalName = Union[str, int]
_ALLOWED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _signal(value: SignalName) -> signal.Signals:
    try:
        sig = signal.Signals[value] if isinstance(value, str) else signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(f"GracefulExit(signals=...): {value!r} is not a signal; use names from {_ALLOWED}") from None
    if sig.name not in _ALLOWED:
        raise ValueError(
            f"GracefulExit(signals=...): {sig.name} cannot be handled for a graceful exit; use names from {_ALLOWED}"
        )
    return sig


def stop_checkpoint_path(trainer: "pl.Trainer", dirpath: Optional[str] = None) -> Optional[Path]:
    """Where a save-and-stop writes: ``dirpath``, else the first ModelCheckpoint's directory, under its
    *last* name (``last.ckpt``: what ``ckpt_path="last"`` resumes). None without either."""
    callback = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)
    name = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
    if callback is not None:
        metrics = {k: v for k, v in trainer.callback_metrics.items()}
        metrics.update(epoch=torch.tensor(trainer.current_epoch), step=torch.tensor(trainer.global_step))
        name = callback.format_checkpoint_name(metrics, filename=callback.CHECKPOINT_NAME_LAST)
        name = Path(name).name
    directory = dirpath if dirpath is not None else getattr(callback, "dirpath", None)
    return Path(directory) / name if directory else None


def save_and_stop(trainer: "pl.Trainer", reason: str, dirpath: Optional[str] = None) -> Optional[Path]:
    """On every rank, at a step boundary: save a checkpoint (see :func:`stop_checkpoint_path`) and make
    the fit end after this step. Returns the checkpoint's path (None when there is nowhere to save)."""
    path = stop_checkpoint_path(trainer, dirpath)
    if path is None:
        rank_zero_warn(
            f"megatron-lite: stopping ({reason}) without a checkpoint: the Trainer has no ModelCheckpoint "
            f"and no dirpath was given; pass GracefulExit(dirpath=...) or enable_checkpointing=True"
        )
    else:
        trainer.save_checkpoint(str(path))
    trainer.should_stop = True
    rank_zero_info(
        f"megatron-lite: {reason}: "
        + (f"saved {path} at step {trainer.global_step}; " if path else "")
        + "stopping after this step"
    )
    return path


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class GracefulExit(pl.Callback):
    """Save and stop at a step boundary on a signal, after ``exit_interval`` steps or after
    ``exit_duration_in_mins`` minutes. MegatronStrategy adds one with the defaults whenever the Trainer
    has a checkpoint callback (``MegatronStrategy(exit_signal_handler=False)`` turns that off).

    Args:
        signals: signal names that ask for a graceful exit (Megatron's ``--exit-signal``; SLURM sends
            SIGTERM, or SIGUSR1 with ``--signal``); ``()``: none.
        exit_interval: stop once the number of optimizer steps taken is a multiple of this.
        exit_duration_in_mins: stop once this many minutes passed since the fit started (any rank's clock).
        dirpath: where to save; None: the checkpoint callback's directory.

    After the fit, ``stop_reason`` says why it stopped early (None: it did not) and ``checkpoint_path``
    where it saved.
    """

    def __init__(
        self,
        signals: Sequence[SignalName] = ("SIGTERM",),
        exit_interval: Optional[int] = None,
        exit_duration_in_mins: Optional[float] = None,
        dirpath: Optional[str] = None,
    ) -> None:
        if isinstance(signals, (str, int)):
            signals = (signals,)
        self.signals = tuple(_signal(s) for s in signals)
        if exit_interval is not None and not _is_positive_int(exit_interval):
            raise ValueError(
                f"GracefulExit(exit_interval={exit_interval!r}) must be a positive number of steps or None"
            )
        if exit_duration_in_mins is not None and (
            isinstance(exit_duration_in_mins, bool)
            or not isinstance(exit_duration_in_mins, (int, float))
            or not exit_duration_in_mins > 0
            or exit_duration_in_mins == float("inf")
        ):
            raise ValueError(
                f"GracefulExit(exit_duration_in_mins={exit_duration_in_mins!r}) must be a positive "
                f"finite number of minutes or None"
            )
        self.exit_interval = exit_interval
        self.exit_duration_in_mins = exit_duration_in_mins
        self.dirpath = dirpath
        self.stop_reason: Optional[str] = None
        self.checkpoint_path: Optional[str] = None
        self._received: Optional[str] = None
        self._start = time.monotonic()

    # --- signals -------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._received is not None:  # the second one: no more grace
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._received = name
        # os.write, not print: a handler may interrupt a print, and print is not reentrant
        os.write(
            2,
            f"megatron-lite: {name} received (pid {os.getpid()}): saving a checkpoint and stopping at the "
            f"end of this step; send it again to exit at once\n".encode(),
        )

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                "megatron-lite: GracefulExit cannot install signal handlers outside the main thread; "
                "signals keep their current handlers"
            )
            return
        for sig in self.signals:
            signal.signal(sig, self._handle)

    # --- hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._start = time.monotonic()
            self.stop_reason = self.checkpoint_path = self._received = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # After Lightning's _SignalConnector registered its handlers (right before the fit loop runs).
        self._install()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stop_reason is not None:
            return
        signalled, over_time = self._agree(trainer)
        reason = None
        if signalled:
            reason = f"a signal ({self._received or 'on another rank'})"
        elif over_time:
            reason = f"exit_duration_in_mins={self.exit_duration_in_mins:g} reached"
        elif self.exit_interval is not None and trainer.global_step % self.exit_interval == 0:
            reason = f"exit_interval={self.exit_interval} reached"
        if reason is None:
            return
        self.stop_reason = reason
        path = save_and_stop(trainer, reason, self.dirpath)
        self.checkpoint_path = str(path) if path is not None else None

    def _agree(self, trainer: "pl.Trainer") -> tuple[bool, bool]:
        """[signal received, budget spent] on any rank: one all-reduce of two integers."""
        over = (
            self.exit_duration_in_mins is not None
            and time.monotonic() - self._start >= 60.0 * self.exit_duration_in_mins
        )
        flags = torch.tensor(
            [int(self._received is not None), int(over)], dtype=torch.int32, device=trainer.strategy.root_device
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, over_time = flags.tolist()
        return bool(signalled), bool(over_time)

    def state_dict(self) -> dict:
        return {}  # nothing to carry over: a resumed run starts a new budget
