"""The only place that touches private Lightning APIs (pinned: lightning 2.4 - 2.6).

Lightning's launchers and its process-group helpers are private; a custom strategy has no public
way to create processes or join a process group. The launchers are subclassed (not wrapped) so
that Lightning's own ``isinstance`` checks on them (killing child ranks on interrupt, refusing
``return_predictions`` under fork) keep working; ``launch`` first runs our configuration checks in
the launching process, before any child exists, so a bad configuration fails once with a clear
message instead of N times from N ranks.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from typing import Any, Callable

from lightning.fabric.utilities.distributed import (  # noqa: F401  (re-exported for the strategy)
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

Validate = Callable[[tuple, dict, Any], None]


class _ValidatingSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's 'popen' launcher (re-runs the script per rank), validated first."""

    def __init__(self, validate: Validate, *args: Any) -> None:
        super().__init__(*args)
        self._validate = validate

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self._validate(args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _ValidatingMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, validated first."""

    def __init__(self, validate: Validate, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._validate = validate

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self._validate(args, kwargs, trainer)
        return super().launch(functools.partial(_run_then_finish_wandb, function), *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer, results: Any):
        # Lightning's logic (2.6), except that rank 0's weights are handed to the launching process
        # as plain tensors: FSDP2 parameters are DTensors, which a process without the process group
        # cannot load, so every rank gathers them first (a collective).
        from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
        from lightning.pytorch.trainer.states import TrainerFn

        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        state_dict = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                      for k, v in trainer.lightning_module.state_dict().items()}
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))


def _run_then_finish_wandb(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` in a forked/spawned rank, then close the rank's W&B run: such a rank ends
    without the interpreter exit that would flush it, and an unfinished offline run keeps no history.
    (Module level so that ``spawn`` can pickle it.)"""
    try:
        return function(*args, **kwargs)
    finally:
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            run.finish()


def make_launcher(strategy, start_method: str, validate: Validate) -> _Launcher:
    """Lightning's subprocess-script launcher ('popen') or multiprocessing launcher, validated."""
    if start_method == "popen":
        return _ValidatingSubprocessScriptLauncher(validate, strategy.cluster_environment, strategy.num_processes,
                                                   strategy.num_nodes)
    return _ValidatingMultiProcessingLauncher(validate, strategy, start_method=start_method)


def attached_trainer(module):
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when detached)."""
    return getattr(module, "_trainer", None)
