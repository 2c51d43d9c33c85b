"""The callbacks MegatronStrategy adds to a run unless the Trainer has them (``log_metrics``,
``exit_signal_handler``). Added in every rank's set-up, before Lightning calls the callbacks' ``setup``: each
runs collectives (the timers' gather, the agreement to stop at a step boundary), so every rank needs it."""

from __future__ import annotations

from typing import Any


def add_default_callbacks(trainer: Any, log_metrics: bool, exit_signal_handler: bool) -> None:
    """A :class:`MegatronMetrics` (with ``log_metrics``) and, where the Trainer has a checkpoint callback to save
    with, a :class:`GracefulExit` (with ``exit_signal_handler``), each unless the Trainer has one."""
    from megatron_lite.callbacks import MegatronMetrics  # here: the strategy's import stays light
    from megatron_lite.callbacks.graceful_exit import GracefulExit

    if trainer is None:
        return
    if log_metrics and not any(isinstance(c, MegatronMetrics) for c in trainer.callbacks):
        trainer.callbacks.append(MegatronMetrics())
    if (
        exit_signal_handler
        and trainer.checkpoint_callback is not None
        and not any(isinstance(c, GracefulExit) for c in trainer.callbacks)
    ):
        trainer.callbacks.append(GracefulExit())
