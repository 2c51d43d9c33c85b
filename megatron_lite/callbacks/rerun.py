"""RerunValidation: the rerun state machine (``megatron_lite.core.rerun``) for a Lightning run.

The machine lives in the training engine (it must check each step after the gradient reduction and
before the optimizer step, and replay it on the same microbatches); this callback only attaches it to
the module's engine, keeps its step number at ``trainer.global_step``, logs its counts, carries its
spike references in checkpoints, and carries out the ``"exit"`` policy: save (as GracefulExit does)
and exit with Megatron's code 16 on every rank.

Logged at every step (cumulative over the run):
``train/rerun_rejected`` (steps whose first attempt failed validation and was replayed),
``train/rerun_transient`` (replays that differed: a transient fault, training went on),
``train/rerun_reproducible`` (replays that reproduced the fault) and
``train/rerun_skipped`` (updates dropped by the policy; also counted in ``train/skipped_steps``).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from megatron_lite.callbacks.graceful_exit import save_and_stop
from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.rerun import EXIT_CODE_RESUME_TO_DISAMBIGUATE, Policy, RerunConfig, RerunStateMachine

METRICS = ("rejected", "transient", "reproducible", "skipped")


class RerunValidation(pl.Callback):
    """Validate every step's loss and gradient norm; replay a rejected step; apply a policy to a
    reproducible fault. The arguments are :class:`megatron_lite.core.rerun.RerunConfig`'s fields.

    Args:
        on_reproducible: ``"exit"`` (default, as Megatron: drop the update, save, exit with code 16 so
            that the launcher restarts the job, on other hardware), ``"skip"`` (drop the update, go on)
            or ``"continue"`` (apply it anyway).
        check_loss: reject NaN/Inf losses and loss spikes.
        check_grad_norm: reject NaN/Inf gradient norms (not under fp16 loss scaling).
        check_grad_norm_spikes: reject grad-norm spikes too.
        spike_factor: a spike is >= spike_factor x the largest of the first spike_window accepted values.
        spike_window: how many accepted values set the spike reference.
        inject: a fault to inject, e.g. ``"nan_loss@3"`` (see ``FaultInjection.parse``); None: the
            ``MEGATRON_LITE_INJECT_FAULT`` environment variable, if set.
        dirpath: where the ``"exit"`` policy saves; None: the checkpoint callback's directory.
    """

    def __init__(
        self,
        on_reproducible: Policy = "exit",
        check_loss: bool = True,
        check_grad_norm: bool = True,
        check_grad_norm_spikes: bool = False,
        spike_factor: float = 10.0,
        spike_window: int = 100,
        inject: Optional[str] = None,
        dirpath: Optional[str] = None,
    ) -> None:
        self.config = RerunConfig(
            check_loss=check_loss,
            check_grad_norm=check_grad_norm,
            check_grad_norm_spikes=check_grad_norm_spikes,
            spike_factor=spike_factor,
            spike_window=spike_window,
            on_reproducible=on_reproducible,
            inject=inject,
        )
        self.dirpath = dirpath
        self.machine: Optional[RerunStateMachine] = None
        self._loaded: Optional[dict] = None

    @staticmethod
    def _engine(pl_module: "pl.LightningModule") -> TrainingEngine:
        engine = getattr(pl_module, "engine", None)
        if not isinstance(engine, TrainingEngine):
            raise TypeError(
                f"RerunValidation checks the steps of the megatron-lite training engine; "
                f"{type(pl_module).__name__} has no `engine` (a TrainingEngine): use it with GPTModule or "
                f"another module that trains through TrainingEngine.train_step, or remove the callback"
            )
        return engine

    def check_before_launch(
        self, run: RunSpec, trainer: "pl.Trainer", pl_module: "pl.LightningModule", datamodule: Any
    ) -> None:
        """MegatronStrategy's pre-launch check: before it starts any rank, and in every rank."""
        if pl_module is not None and not isinstance(getattr(type(pl_module), "engine", None), property):
            self._engine(pl_module)  # raises, naming the fix

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.machine = RerunStateMachine(self.config, rank=trainer.global_rank)
        if self._loaded is not None:
            self.machine.load_state_dict(self._loaded)
            self._loaded = None
        if self.machine.injection is not None:
            rank_zero_warn(f"megatron-lite: injecting a fault for a drill: {self.machine.injection}")
        self._engine(pl_module).rerun = self.machine

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self.machine is not None:
            self.machine.step = trainer.global_step

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        machine = self.machine
        if machine is None:
            return
        for name in METRICS:
            pl_module.log(f"train/rerun_{name}", float(getattr(machine.counts, name)), rank_zero_only=True)
        if machine.exit_requested:
            step, what, verdict = machine.counts.reasons[-1]
            save_and_stop(
                trainer,
                f"a {verdict} fault at step {step} ({what}): exit code "
                f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE}, restart from the checkpoint",
                self.dirpath,
            )
            raise SystemExit(EXIT_CODE_RESUME_TO_DISAMBIGUATE)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._detach(pl_module)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._detach(pl_module)

    def _detach(self, pl_module: "pl.LightningModule") -> None:
        engine = getattr(pl_module, "_engine", None)
        if isinstance(engine, TrainingEngine) and engine.rerun is self.machine:
            engine.rerun = None

    def state_dict(self) -> dict:
        return self.machine.state_dict() if self.machine is not None else (self._loaded or {})

    def load_state_dict(self, state_dict: dict) -> None:
        self._loaded = dict(state_dict)
