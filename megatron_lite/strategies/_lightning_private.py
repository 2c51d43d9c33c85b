"""The only place that touches private Lightning APIs (pinned: lightning 2.4 - 2.6).

Lightning's launchers and its process-group helpers are private; a custom strategy has no public
way to create processes or join a process group. ``launch`` first runs our configuration checks in
the launching process, before any child exists, so a bad configuration fails once with a clear
message instead of N times from N ranks.

- 'popen' (scripts): Lightning's subprocess-script launcher, subclassed so that Lightning's
  ``isinstance`` checks (killing child ranks on Ctrl-C) keep working; the first failing rank's error
  is what every rank exits with (see ``rank_failure``), and a failed child leaves rank 0 time to say so.
- ranks that torchrun, SLURM or the 'popen' launcher started: an in-place launcher that starts nothing. A
  launcher is where Lightning hands over the arguments of ``fit`` before resolving ``ckpt_path``, which
  ``ckpt_path="last"`` needs (see ``auto_resume``); Lightning's own strategies keep a launcher there too.
- fork/spawn (notebooks, tests): Lightning's multiprocessing launcher, *wrapped* rather than
  subclassed. Lightning refuses ``return_predictions`` for any ``_MultiProcessingLauncher`` because
  it would return only rank 0's share; ours returns every data-parallel rank's predictions merged, so
  it must not be one. The ranks hand the whole trained model back (full tensors as safetensors files
  in a directory the launching process made, one per distinct piece) with ``callback_metrics`` and the
  fit loop's progress; the launching process raises the first failing rank's exception.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import (  # noqa: F401  (re-exported for the strategy)
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from megatron_lite.strategies.ports import rendezvous_port
from megatron_lite.strategies.rank_failure import (
    RUN_DIR_ENV,
    next_run_number,
    read_failure,
    rebuild_exception,
    record_failure,
)

# Checks the arguments of trainer.fit/validate/test/predict (positional, kwargs, the trainer); returns the
# positional arguments to run with (ckpt_path="last" replaced).
Validate = Callable[[tuple, dict, Any], tuple]

# Seconds the script (rank 0) is left to report a failed child's error before the watcher kills it.
_GRACE_S = 30.0
# Seconds the child ranks are left to exit on their own once rank 0 knows the run failed.
_STOP_GRACE_S = 2.0
# Seconds the child ranks are left to finish a deliberate exit (SystemExit) that rank 0 makes too.
_EXIT_GRACE_S = 60.0


class _ValidatingSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's 'popen' launcher (re-runs the script per rank), validated first; every rank exits
    with the first failing rank's error."""

    def __init__(self, strategy, validate: Validate, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy
        self._validate = validate

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        args = self._validate(args, kwargs, trainer)
        alone = self.num_processes * self.num_nodes == 1 and not self.cluster_environment.creates_processes_externally
        if not alone:
            return self._launch(function, *args, **kwargs)
        # One process, run right here (a notebook, a test): Lightning's launch would leave LOCAL_RANK,
        # WORLD_SIZE, MASTER_PORT... in this process's environment and its one-rank process group alive,
        # and a later multi-process run from the same process (or a script it starts) would read them as
        # "launched externally, world size 1". Nothing of this run needs them afterwards.
        try:
            with restored_environment():
                return self._launch(function, *args, **kwargs)
        finally:
            self._strategy.release_process_groups()

    def _launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        # Lightning's launch, except for the run directory (inherited by the child scripts) and the
        # observer of the children (ours waits before it kills; see _ChildWatcher).
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        launching = not self.cluster_environment.creates_processes_externally
        if launching and not os.environ.get(RUN_DIR_ENV):
            run_dir = tempfile.mkdtemp(prefix="megatron-lite-run-")
            os.environ[RUN_DIR_ENV] = run_dir
            atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
        self._strategy.launch.begin(os.environ.get(RUN_DIR_ENV), next_run_number())
        if launching:
            self._call_children_scripts()
            _ChildWatcher(os.getpid(), self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except SystemExit:
            # A deliberate exit every rank agreed on (the rerun policy's code 16): the children exit with the
            # same code by themselves; not a failure to attribute.
            self._wait_for_children(_EXIT_GRACE_S)
            raise
        except BaseException as error:
            rank = self._strategy.launch.process_rank
            failure = self._strategy.launch.failure_file
            record_failure(failure, rank, error)  # unless the strategy's on_exception did already
            record = read_failure(failure)
            if record is None or record["rank"] == rank:
                self._stop_children()
                raise
            if rank != 0:
                # A consequence of another rank's failure (a collective that lost its peer): that rank
                # and rank 0 report it; this one exits quietly.
                raise SystemExit(1) from None
            self._stop_children()
            first = rebuild_exception(record)
            raise first from first.__cause__

    def _wait_for_children(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _stop_children(self) -> None:
        """End the child ranks once rank 0 knows the run failed. Their errors are consequences (the
        failing child has already exited: rank 0 notices only when its connections close). A child
        still waiting on rank 0 would wait for the collective timeout: the groups cannot close their
        sockets while the model holds them, so it is killed after a moment to exit on its own."""
        self._wait_for_children(_STOP_GRACE_S)


class _ChildWatcher(threading.Thread):
    """Lightning's observer of the child ranks (it kills every rank, the script included, when a child
    fails: a rank stuck in a collective may never return), with a grace period: Lightning's kills the
    script within 5 s, often before rank 0 has said what went wrong."""

    def __init__(self, main_pid: int, procs: list, period_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="megatron-lite-child-watcher")
        self._main_pid, self._procs, self._period_s = main_pid, procs, period_s

    def run(self) -> None:
        while True:
            time.sleep(self._period_s)
            codes = [p.poll() for p in self._procs]
            if all(code == 0 for code in codes):
                return
            if any(code not in (None, 0) for code in codes):
                time.sleep(_GRACE_S)  # the script normally exits meanwhile, and this thread with it
                for p in self._procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
                os.kill(self._main_pid, signal.SIGKILL)
                return


class _RankZeroResults(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher. Rank 0 sends back ``callback_metrics`` and the fit loop's
    progress; the model comes back as files (see MegatronStrategy.teardown), not as rank 0's
    ``state_dict``, which holds only its shards (or nothing: the model is built in the ranks)."""

    rank_zero_predictions: Any = None

    def _collect_rank_zero_results(self, trainer, results: Any) -> Optional[_WorkerOutput]:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        extra = self.get_extra_results(trainer)
        if trainer.state.fn == TrainerFn.PREDICTING and results is not None:
            # As a file in the run's directory: tensors put on the queue travel as shared memory that dies with
            # this process, before the launching process reads them, and anything put on the queue (a pipe) past
            # its ~64 KiB buffer blocks this rank until the launching process reads -- which it does only after
            # every rank has exited: a deadlock for all but tiny predictions.
            path = os.path.join(self._strategy.launch.run_dir, "rank_zero_predictions.pt")
            torch.save(results, path)
            extra["predictions_file"], results = path, None
        return _WorkerOutput(best_model_path, None, trainer.state, results, extra)

    def get_extra_results(self, trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            extra["fit_loop_state_json"] = json.dumps(trainer.fit_loop.state_dict())
        return extra

    def update_main_process_results(self, trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "fit_loop_state_json" in extra:  # trainer.global_step, current_epoch in the notebook
            trainer.fit_loop.load_state_dict(json.loads(extra["fit_loop_state_json"]))
        self.rank_zero_predictions = None
        if "predictions_file" in extra:
            try:
                self.rank_zero_predictions = torch.load(extra["predictions_file"], weights_only=True)
            except Exception as error:  # weights_only refuses arbitrary objects: nothing is unpickled
                raise TypeError(
                    f"predict_step returned objects that cannot be handed back to this process "
                    f"without unpickling them ({error}); return tensors (or dicts/lists of tensors), "
                    f"or write predictions with a BasePredictionWriter callback."
                ) from None


class _MegatronMultiProcessingLauncher(_Launcher):
    """Fork/spawn ranks through Lightning's launcher (see the module docstring for why it wraps it)."""

    def __init__(self, strategy, validate: Validate, start_method: str) -> None:
        self._strategy = strategy
        self._validate = validate
        self._launcher = _RankZeroResults(strategy, start_method=start_method)

    @property
    def is_interactive_compatible(self) -> bool:
        return self._launcher.is_interactive_compatible

    @property
    def procs(self) -> list:
        return self._launcher.procs

    def kill(self, signum) -> None:
        self._launcher.kill(signum)

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        args = self._validate(args, kwargs, trainer)
        if trainer is not None:
            _settle_logger_versions(trainer)
        run_dir = tempfile.mkdtemp(prefix="megatron-lite-run-")
        self._strategy.launch.begin(run_dir, next_run_number())
        try:
            # Lightning's launcher sets MASTER_PORT (and more) in this process for the ranks it starts: the
            # notebook's environment is left as it was found.
            with restored_environment():
                _choose_rendezvous_port(self._strategy)
                result = self._launch_ranks(function, *args, trainer=trainer, **kwargs)
            if trainer is not None and trainer.state.fn == TrainerFn.PREDICTING:
                result = self._launcher.rank_zero_predictions
            if trainer is not None and trainer.state.status == TrainerStatus.FINISHED:
                result = self._strategy.launch.receive_results(trainer, run_dir, result)
            return result
        finally:
            self._strategy.launch.begin(None, -1)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _launch_ranks(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        """Lightning's launch; the first failing rank's exception raised here."""
        try:
            with _heap_frozen_for_fork(self._launcher._start_method == "fork"):
                return self._launcher.launch(
                    functools.partial(_run_rank, self._strategy, function), *args, trainer=trainer, **kwargs
                )
        except (ProcessRaisedException, ProcessExitedException):
            record = read_failure(self._strategy.launch.failure_file)
            if record is None:
                raise  # no rank recorded an exception (one was killed): torch's report is all there is
            first = rebuild_exception(record)
            raise first from first.__cause__


@contextlib.contextmanager
def _heap_frozen_for_fork(forking: bool) -> Iterator[None]:
    """While ranks are forked from this process: its objects moved out of the cyclic garbage collector's sight
    (``gc.freeze``), as Python's ``gc`` documentation advises right before ``fork()``. A forked rank's
    collections, and the last one at its exit, then never walk (and copy-on-write) the hundreds of thousands of
    objects torch and Lightning left in the parent (about a second of CPU per rank); the parent takes them back
    (``gc.unfreeze``) once its ranks are done."""
    if not forking:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _choose_rendezvous_port(strategy) -> None:
    """``MASTER_PORT`` for the ranks this process starts, outside the kernel's ephemeral range
    (:mod:`megatron_lite.strategies.ports`), unless the user set one or a cluster (torchrun, SLURM, ...) gives it.
    Lightning's environment reads ``MASTER_PORT`` when it first needs the port (and keeps it for the Trainer's later
    launches)."""
    if "MASTER_PORT" in os.environ or type(strategy.cluster_environment) is not LightningEnvironment:
        return
    port = rendezvous_port()
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """Run the block, then put back every environment variable it set, changed or removed."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _settle_logger_versions(trainer) -> None:
    """Resolve each logger's version here, before the ranks start: a logger resolves it lazily (the next free
    ``version_N``), and in forked ranks that resolution would be lost with them, so every validate/predict of
    one Trainer would open a new version. Resolved once here, the ranks inherit it, as a Trainer that runs in
    this process keeps its version."""
    for logger in trainer.loggers:
        logger.version  # noqa: B018 - the property resolves and keeps it


class InPlaceLauncher(_Launcher):
    """The launcher of a rank that was started by torchrun, SLURM or the 'popen' launcher: it starts nothing
    and runs ``function`` here, with the arguments ``prepare`` returns (``ckpt_path="last"`` replaced; the
    configuration is validated later, in ``setup_environment``, as before)."""

    def __init__(self, prepare: Validate) -> None:
        self._prepare = prepare

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        args = self._prepare(args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum) -> None:
        pass  # it started no process (Lightning's SIGTERM handler calls this)


def _run_rank(strategy, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` in a forked/spawned rank (module level so that ``spawn`` can pickle it).

    On an exception: the first failing rank records it (Lightning's error handling runs in the
    launching process, not here, so the strategy's ``on_exception`` never sees it); it records before
    this process exits and closes its connections, so the peers' collective errors come later. A rank
    whose error is such a consequence exits at once and says nothing. In any case the rank's W&B run is
    closed: such a rank ends without the interpreter exit that would flush it, and an unfinished
    offline run keeps no history."""
    try:
        return function(*args, **kwargs)
    except SystemExit:
        raise  # a deliberate exit (every rank agreed on it): the process ends with its code
    except BaseException as error:
        rank = strategy.launch.process_rank
        record_failure(strategy.launch.failure_file, rank, error)
        record = read_failure(strategy.launch.failure_file)
        if record is not None and record["rank"] != rank:
            _finish_wandb()
            sys.stderr.flush()
            os._exit(1)  # no traceback, no atexit: the launching process reports the first failure
        raise
    finally:
        _finish_wandb()


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        run.finish()


def make_launcher(strategy, start_method: str, validate: Validate) -> _Launcher:
    """Lightning's subprocess-script launcher ('popen') or multiprocessing launcher, validated."""
    if start_method == "popen":
        return _ValidatingSubprocessScriptLauncher(
            strategy, validate, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    return _MegatronMultiProcessingLauncher(strategy, validate, start_method)


def checkpoint_callback_dir(callback, trainer) -> Optional[str]:
    """The directory a checkpoint callback saves into: its ``dirpath``; for a ModelCheckpoint without one, the
    directory Lightning derives when it saves (from the first logger's save_dir/name/version, else
    ``default_root_dir``/checkpoints), through ModelCheckpoint's private ``__resolve_ckpt_dir`` -- the one
    Lightning's own ``ckpt_path="last"`` look-up uses. None for a callback without a directory."""
    dirpath = getattr(callback, "dirpath", None)
    if dirpath is not None:
        return str(dirpath)
    if isinstance(callback, ModelCheckpoint):
        return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))
    return None


def attached_trainer(module):
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when detached)."""
    return getattr(module, "_trainer", None)


def predictions_with_indices(trainer) -> list[tuple[list[Any], list[list[int]], Optional[int]]]:
    """Per predict dataloader: (this rank's predictions, the dataset indices of each of its batches,
    the loader's batch size). Lightning records the indices in its batch-sampler wrapper."""
    loop = trainer.predict_loop
    combined = loop._combined_loader
    loaders = list(combined.flattened) if combined is not None else []
    out = []
    for k, loader in enumerate(loaders):
        sampler = getattr(loader, "batch_sampler", None)
        indices = list(sampler.seen_batch_indices) if isinstance(sampler, _IndexBatchSamplerWrapper) else []
        inner = getattr(sampler, "_batch_sampler", None)
        batch_size = getattr(loader, "batch_size", None) or getattr(inner, "batch_size", None)
        predictions = loop._predictions[k] if k < len(loop._predictions) else []
        out.append((list(predictions), indices[: len(predictions)], batch_size))
    return out
