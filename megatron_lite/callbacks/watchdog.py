"""HangWatchdog: the hang watchdog of ``megatron_lite.core.watchdog`` for a Lightning fit.

Heartbeats at every step's start and end, around validation batches and at checkpoint saves; when
none comes for ``timeout_s`` seconds, every rank's Python stacks go to stderr (and to
``<dump_dir>/rank<r>.txt``) and the process exits with code 124, for torchrun ``--max-restarts`` or the
cluster's requeue to restart the job from its last checkpoint.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

from megatron_lite.core.watchdog import WATCHDOG_EXIT_CODE, Watchdog


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"HangWatchdog({name}={value!r}) must be a positive finite number of seconds"
            + (" or None" if allow_none else "")
        )


class HangWatchdog(pl.Callback):
    """Dump every rank's stacks and exit non-zero when a rank makes no progress for ``timeout_s`` seconds.

    Args:
        timeout_s: seconds a step (or the gap between steps, a validation batch, a checkpoint save) may
            take; set it well above the slowest step.
        first_step_timeout_s: for the first step (warm-up, first batch); None: 3 x ``timeout_s``.
        dump_dir: a directory every rank can write (each rank's stacks, and the alarm that makes the
            other ranks dump at once); None: ``<default_root_dir>/watchdog``. Written only if it fires.
        linger_s: seconds a firing rank waits before exiting, for the others to dump their stacks.
        exit_code: the exit code of a rank whose watchdog fired (default 124).
    """

    def __init__(
        self,
        timeout_s: float = 600.0,
        first_step_timeout_s: Optional[float] = None,
        dump_dir: Optional[str] = None,
        linger_s: float = 5.0,
        exit_code: int = WATCHDOG_EXIT_CODE,
    ) -> None:
        _positive("timeout_s", timeout_s)
        _positive("first_step_timeout_s", first_step_timeout_s, allow_none=True)
        if isinstance(linger_s, bool) or not isinstance(linger_s, (int, float)) or not 0 <= linger_s < math.inf:
            raise ValueError(f"HangWatchdog(linger_s={linger_s!r}) must be a finite number of seconds >= 0")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise ValueError(
                f"HangWatchdog(exit_code={exit_code!r}) must be a non-zero exit status (1..255) so that "
                f"the launcher sees the failure"
            )
        self.timeout_s = float(timeout_s)
        self.first_step_timeout_s = (
            float(first_step_timeout_s) if first_step_timeout_s is not None else 3 * self.timeout_s
        )
        self.dump_dir, self.linger_s, self.exit_code = dump_dir, float(linger_s), exit_code
        self.watchdog: Optional[Watchdog] = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        run_id = trainer.strategy.broadcast(uuid.uuid4().hex[:12])  # the same alarm name on every rank
        dump_dir = self.dump_dir if self.dump_dir is not None else str(Path(trainer.default_root_dir) / "watchdog")
        self.watchdog = Watchdog(
            self.timeout_s,
            rank=trainer.global_rank,
            dump_dir=dump_dir,
            run_id=run_id,
            linger_s=self.linger_s,
            exit_code=self.exit_code,
        )

    def _beat(self, where: str, timeout_s: Optional[float] = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(where, timeout_s)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.watchdog is not None:
            self.watchdog.start()
            self._beat(f"in the first step ({trainer.global_step})", self.first_step_timeout_s)
            self._first = True

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if getattr(self, "_first", False):
            self._first = False
            return  # the first step keeps its longer timeout
        self._beat(f"in training step {trainer.global_step}")

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._beat(
            f"between training steps {trainer.global_step - 1} and {trainer.global_step} (loading data, callbacks)"
        )

    def on_validation_batch_end(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._beat("in validation")

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._beat("in validation")

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._beat("after validation")

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        self._beat(f"saving a checkpoint at step {trainer.global_step}")

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._disarm()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._disarm()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._disarm()

    def _disarm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
