"""MegatronStrategy's launch half: the launcher it gives Lightning (``_lightning_private``'s), what the launching
process checks and prepares before any rank starts, the checks each rank repeats in its set-up, and the run's
directory and failure file the ranks share.

In the launching process (a script, a notebook) the launcher calls :meth:`StrategyLaunch.check_and_prepare` with the
arguments of ``trainer.fit/validate/test/predict`` before it starts a rank: the ``ckpt_path`` (``launch_checks``), the
run's pre-launch checks (``pre_launch``), saves a crash interrupted, then ``ckpt_path="last"`` replaced
(``auto_resume``). A rank that torchrun, SLURM or the popen launcher started launches nothing: its in-place launcher
only replaces ``ckpt_path="last"``, and its set-up (:meth:`StrategyLaunch.check_rank`) runs the pre-launch checks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn

from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.strategies._lightning_private import InPlaceLauncher, make_launcher
from megatron_lite.strategies.auto_resume import AutoResume, recover_interrupted_saves, replace_last
from megatron_lite.strategies.checkpointing import refuse_without_weights
from megatron_lite.strategies.default_callbacks import add_default_callbacks
from megatron_lite.strategies.hand_back import receive_results
from megatron_lite.strategies.launch_checks import (
    check_checkpoint_dirs,
    check_checkpoint_fits,
    check_ckpt_path,
    ckpt_path_of,
)
from megatron_lite.strategies.pre_launch import check_run
from megatron_lite.strategies.rank_failure import RUN_DIR_ENV, failure_file, next_run_number

if TYPE_CHECKING:
    from megatron_lite.strategies.megatron import MegatronStrategy


class StrategyLaunch:
    """How one MegatronStrategy's runs are launched, and what a launch leaves it: the run description the checks
    received, ``ckpt_path="last"`` as replaced, and the run's directory and failure file."""

    def __init__(self, strategy: "MegatronStrategy") -> None:
        self._strategy = strategy
        self.run_spec: Optional[RunSpec] = None
        """The description of the current run that the pre-launch checks received (None before)."""
        self.auto_resume: Optional[AutoResume] = None
        """``ckpt_path="last"`` as replaced for the current run (see ``auto_resume``); None otherwise."""
        self.run_dir: Optional[str] = None
        """Where the ranks hand results back, set by the launcher (None outside a launch)."""
        self.failure_file: Optional[str] = None
        """Where the current run records its first failure (see ``rank_failure``)."""

    def launcher(self) -> _Launcher:
        """A launcher that starts the ranks (``start_method``) once the launching process's checks passed; in a rank
        that torchrun, SLURM or the popen launcher started, one that starts nothing but still receives the
        arguments of fit (``ckpt_path="last"``)."""
        strategy = self._strategy
        assert strategy.cluster_environment is not None
        if strategy.cluster_environment.creates_processes_externally:
            return InPlaceLauncher(self._prepare_args)
        return make_launcher(strategy, strategy.options.start_method, self.check_and_prepare)

    @property
    def started_externally(self) -> bool:
        """Whether this process is a rank that torchrun, SLURM or the popen launcher started (no launching of its
        own)."""
        launcher = self._strategy.launcher
        return launcher is None or isinstance(launcher, InPlaceLauncher)

    @property
    def forked(self) -> bool:
        """Whether the current run's ranks are forked/spawned processes that hand their results back to the
        launching process and end (in that process, while the launch runs, and in those ranks)."""
        return self.run_dir is not None and self._strategy.options.start_method != "popen"

    def check_and_prepare(self, args: tuple, kwargs: dict, trainer: Any) -> tuple:
        """In the launching process, before any rank starts: check the run given to ``trainer.<fn>`` (positional
        ``args`` of Lightning's ``_<fn>_impl``, ``kwargs``) and return the positional arguments to run with."""
        strategy = self._strategy
        objects = [*args, *kwargs.values()]
        module = next((o for o in objects if isinstance(o, LightningModule)), None)
        datamodule = next((o for o in objects if isinstance(o, LightningDataModule)), None)
        refuse_without_weights(module)
        ckpt_path = ckpt_path_of(args)
        check_ckpt_path(ckpt_path)
        check_checkpoint_dirs(trainer)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        check_checkpoint_fits(ckpt_path, module, fitting, list(getattr(trainer, "callbacks", None) or []))
        self.run_spec = check_run(strategy, module, datamodule, trainer, strategy.num_nodes * strategy.num_processes)
        recover_interrupted_saves(trainer)
        return self._prepare_args(args, kwargs, trainer)

    def _prepare_args(self, args: tuple, kwargs: dict, trainer: Any) -> tuple:
        """The arguments of fit/validate/test/predict to run with: ``ckpt_path="last"`` replaced by what resumes the
        newest valid checkpoint (or None: start from the beginning), in every process that calls ``trainer.fit`` --
        the launching process and each rank started by torchrun or SLURM."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        args, self.auto_resume = replace_last(args, trainer, fitting)
        return args

    def check_rank(self, trainer: Any) -> None:
        """In every rank's set-up, before its process groups exist: the pre-launch checks again (under torchrun or
        SLURM no launcher ran them), the strategy's default callbacks, and in a rank re-running the user's script
        the run's directory that rank 0 made."""
        strategy = self._strategy
        check_checkpoint_dirs(trainer)
        self.run_spec = check_run(
            strategy,
            strategy.lightning_module,
            getattr(trainer, "datamodule", None),
            trainer,
            strategy.num_nodes * strategy.num_processes,
            device=strategy.root_device,
        )
        add_default_callbacks(trainer, strategy.options.log_metrics, strategy.options.exit_signal_handler)
        if self.started_externally and os.environ.get(RUN_DIR_ENV):
            self.begin(os.environ[RUN_DIR_ENV], next_run_number())

    def begin(self, run_dir: Optional[str], sequence: int) -> None:
        """Called by the launcher: the run's directory (None once it is over) and its number."""
        self.run_dir = run_dir
        self.failure_file = failure_file(run_dir, sequence)

    @property
    def process_rank(self) -> int:
        """This process's global rank, from the launcher's environment (valid before set-up)."""
        environment = self._strategy.cluster_environment
        assert environment is not None
        return environment.node_rank() * self._strategy.num_processes + environment.local_rank()

    def receive_results(self, trainer: Any, run_dir: str, rank_zero_result: Any) -> Any:
        """In the launching process after the ranks finished (see ``hand_back``)."""
        return receive_results(self._strategy, trainer, run_dir, rank_zero_result)
