"""MegatronStrategy: Megatron-style tensor, sequence and data parallelism for Lightning's Trainer.

The strategy is thin: it launches processes, builds the :class:`ParallelLayout` (process groups
over a DeviceMesh), tells Lightning how to split data over DP ranks, and writes distributed
checkpoints. The training step itself (microbatch schedule, gradient reduction, clipping) lives in
``megatron_lite.core`` and is driven by the LightningModule (see :class:`megatron_lite.GPTModule`).
"""
from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from megatron_lite.core.checkpoint.checkpointer import Checkpointer
from megatron_lite.core.checkpoint.errors import EntryMismatchError
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import resolve_checkpoint
from megatron_lite.core.checkpoint.resume.entries import holds_training_state, read_meta_plain
from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.run_spec import RunSpec, check_bucket_size
from megatron_lite.strategies.default_callbacks import add_default_callbacks
from megatron_lite.strategies.hand_back import hand_back, receive_results
from megatron_lite.strategies.launch_checks import (
    check_checkpoint_fits,
    check_ckpt_path,
    ckpt_path_of,
    mismatch_message,
    weights_only_message,
)
from megatron_lite.strategies.pre_launch import check_run
from megatron_lite.strategies.precision import MegatronPrecision, as_megatron_precision
from megatron_lite.strategies.process_groups import join_process_groups, release_process_groups
from megatron_lite.strategies._lightning_private import (
    InPlaceLauncher,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
    attached_trainer,
    make_launcher,
)
from megatron_lite.strategies.auto_resume import AutoResume, recover_interrupted_saves, replace_last, resume_checkpoint
from megatron_lite.strategies.checkpointing import (
    checkpoint_classes,
    refuse_checkpoint_io,
    refuse_without_weights,
    saves_asynchronously,
)
from megatron_lite.strategies.rank_failure import RUN_DIR_ENV, failure_file, next_run_number, report_rank_failure


log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class MegatronStrategy(ParallelStrategy):
    """Tensor (+ sequence), pipeline, context and data parallelism with Megatron's argument names.

    Args:
        tensor_model_parallel_size: ranks that split every layer's weights (heads, FFN, vocabulary).
        sequence_parallel: shard LayerNorm/dropout activations along the sequence inside TP groups.
        pipeline_model_parallel_size: ranks that split the layers into consecutive stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved schedule).
        pipeline_schedule: ``"1f1b"`` (default), ``"interleaved_1f1b"`` (default with virtual stages) or
            ``"gpipe"``.
        num_layers_in_first_pipeline_stage: layers of the first stage for an uneven cut.
        num_layers_in_last_pipeline_stage: layers of the last stage for an uneven cut.
        context_parallel_size: ranks that split every sequence into ``2 x C`` chunks, rank r holding chunks r
            and 2C-1-r; exact attention (log-sum-exp merge). Needs ``seq_length`` divisible by ``2 x C`` (by
            ``2 x C x TP`` under sequence parallelism) and ``attention_dropout=0``.
        cp_comm_type: how CP attention gets the other ranks' keys and values: ``"p2p"`` (around the ring, one
            block in flight) or ``"all_gather"`` (the whole sequence's at once).
        use_torch_fsdp2: shard parameters, gradients and optimizer state over the data-parallel ranks
            with PyTorch's FSDP2 (ZeRO-3), composed with TP. For ZeRO-1 (sharded optimizer state and
            fp32 masters only) set ``OptimizerConfig(use_distributed_optimizer=True)`` instead.
        ddp_bucket_size: elements per gradient bucket (Megatron's ``--ddp-bucket-size``; default
            max(40M, 1M x dp)).
        log_metrics: add a :class:`megatron_lite.callbacks.MegatronMetrics` callback (throughput, TFLOP/s,
            MFU, memory, timers, Megatron's console line) unless the Trainer has one.
        async_save: checkpoints saved by callbacks during ``fit`` (Lightning's ``ModelCheckpoint``) are
            written in the background: the save copies the state to host memory and returns, DCP writes
            the files in a thread, and the checkpoint is committed (renamed into place, recorded as
            latest) once every rank's files are written. The next save, the end of ``fit`` and the
            teardown wait for it, and raise its error. Other saves (``trainer.save_checkpoint`` called by
            you) stay synchronous unless called with ``storage_options={"async_save": True}``.
        overlap_grad_reduce: reduce each gradient bucket over DP (all-reduce, or reduce-scatter with
            the distributed optimizer) asynchronously during the backward of the last microbatch
            (Megatron's ``--overlap-grad-reduce``). FSDP2 always overlaps its reductions.
        check_memory: refuse a run whose estimated memory (``megatron-lite estimate``'s) exceeds the host's
            available memory (CPU: its ranks together) or a GPU's free memory, before anything is built.
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA by default.
        timeout: how long a collective waits for its peers, in every process group of the run (the
            layout's tensor/pipeline/data/context-parallel groups too), before it fails.
        exit_signal_handler: on SIGTERM (to any rank) save a checkpoint into the checkpoint callback's
            directory (``last.ckpt``, what ``ckpt_path="last"`` resumes) and stop at the next step boundary,
            whenever the Trainer has a checkpoint callback: adds a
            :class:`megatron_lite.callbacks.GracefulExit` unless the Trainer already has one (pass your own
            for other signals, ``exit_interval`` or ``exit_duration_in_mins``). ``False``: no such callback.
        start_method: ``"popen"`` (re-run the script per rank; scripts and the CLI), ``"fork"``
            (notebooks and tests) or ``"spawn"``. Ignored under torchrun / SLURM, which start the ranks.
            With fork/spawn the ranks hand back to the launching process the whole trained model (full
            tensors, loaded into a one-process model: ``module.model``), ``callback_metrics``, the fit
            loop's progress and every data-parallel rank's predictions; a rank's exception is raised there.
        checkpoint_io: not taken (a CheckpointIO plugin is refused, here or in ``Trainer(plugins=...)``): the
            strategy writes its distributed checkpoints itself (see ``async_save`` for background saves).
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int = 1,
        pipeline_schedule: Optional[str] = None,
        num_layers_in_first_pipeline_stage: Optional[int] = None,
        num_layers_in_last_pipeline_stage: Optional[int] = None,
        context_parallel_size: int = 1,
        cp_comm_type: str = "p2p",
        use_torch_fsdp2: bool = False,
        ddp_bucket_size: Optional[int] = None,
        overlap_grad_reduce: bool = False,
        log_metrics: bool = True,
        exit_signal_handler: bool = True,
        async_save: bool = False,
        check_memory: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        refuse_checkpoint_io(checkpoint_io)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}")
        # Validates sizes (and sequence_parallel without TP) at construction, before anything starts.
        self.parallel_config = ParallelConfig(
            tensor_model_parallel_size=tensor_model_parallel_size, sequence_parallel=sequence_parallel,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            pipeline_schedule=pipeline_schedule,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
            context_parallel_size=context_parallel_size, cp_comm_type=cp_comm_type)
        check_bucket_size(ddp_bucket_size)
        self.use_torch_fsdp2 = bool(use_torch_fsdp2)
        self.ddp_bucket_size = ddp_bucket_size
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.log_metrics = bool(log_metrics)
        self.exit_signal_handler = bool(exit_signal_handler)
        self.async_save = bool(async_save)
        self.check_memory = bool(check_memory)
        # The Checkpointer of this run, and what it was made for (see _checkpointer).
        self._checkpointer_in_use: Optional[Checkpointer] = None
        self._checkpointer_sources: tuple = ()
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._layout: Optional[ParallelLayout] = None
        self._created_default_group = False
        # The global CPU generator's state to set before the first step after a checkpoint load.
        self._pending_cpu_rng: Optional[Tensor] = None
        # ckpt_path="last" as replaced by the launcher (see strategies/auto_resume.py); None otherwise.
        self._auto_resume: Optional[AutoResume] = None
        # Set by the launcher: where the ranks hand results back and record the first failure.
        self._run_dir: Optional[str] = None
        self._failure_file: Optional[str] = None
        self._run_spec: Optional[RunSpec] = None
        self.memory_estimate = None
        """The per-rank memory estimate logged when ``fit`` starts (a MemoryEstimate), if one could be made: the
        most loaded pipeline stage's, every stage's in ``.stages`` (this rank's: ``.stages[pp_rank]``)."""

    # --- sizes and devices ----------------------------------------------------------------
    @property
    def parallel_layout(self) -> Optional[ParallelLayout]:
        """The layout of this run (None until the process group exists)."""
        return self._layout

    @property
    def run_spec(self) -> Optional[RunSpec]:
        """The description of the current run (layout, data geometry, precision, FSDP2 and bucket options) that the
        pre-launch checks received; built in the launching process and again in each rank (None before)."""
        return self._run_spec

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def precision_plugin(self) -> MegatronPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else MegatronPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        # Lightning installs its own plugin for Trainer(precision=...); ours keeps the dtype choice
        # and leaves loss scaling to the core optimizer (see strategies/precision.py).
        self._precision_plugin = None if plugin is None else as_megatron_precision(plugin)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split over DP ranks only: TP ranks of one replica read the same samples.
        if self._layout is None:
            dp = self.parallel_config.data_parallel_size(self.num_nodes * self.num_processes)
            return {"num_replicas": dp, "rank": self.global_rank // self.parallel_config.model_parallel_size}
        return {"num_replicas": self._layout.dp_size, "rank": self._layout.dp_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    # --- launch and set-up ----------------------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            # torchrun / SLURM / the popen launcher started every rank already: nothing to start, but the
            # arguments of fit still pass through here (ckpt_path="last")
            self._launcher = InPlaceLauncher(self._prepare_run_args)
            return
        self._launcher = make_launcher(self, self._start_method, self._validate_launch_args)

    @property
    def _started_externally(self) -> bool:
        """Whether this process is a rank that torchrun, SLURM or the popen launcher started (no launching of its own)."""
        return self._launcher is None or isinstance(self._launcher, InPlaceLauncher)

    def _validate_launch_args(self, args: tuple, kwargs: dict, trainer) -> tuple:
        objects = [*args, *kwargs.values()]
        module = next((o for o in objects if isinstance(o, LightningModule)), None)
        datamodule = next((o for o in objects if isinstance(o, LightningDataModule)), None)
        refuse_without_weights(module)
        ckpt_path = ckpt_path_of(args)
        check_ckpt_path(ckpt_path)
        check_checkpoint_fits(ckpt_path, module, trainer is not None and trainer.state.fn == TrainerFn.FITTING)
        self._run_spec = check_run(self, module, datamodule, trainer, self.num_nodes * self.num_processes)
        recover_interrupted_saves(trainer)
        return self._prepare_run_args(args, kwargs, trainer)

    def _prepare_run_args(self, args: tuple, kwargs: dict, trainer) -> tuple:
        """The arguments of fit/validate/test/predict to run with: ``ckpt_path="last"`` replaced by what
        resumes the newest valid checkpoint (or None: start from the beginning), in every process that
        calls ``trainer.fit`` -- the launching process and each rank started by torchrun or SLURM."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        args, self._auto_resume = replace_last(args, trainer, fitting)
        return args

    def setup_environment(self) -> None:
        super().setup_environment()
        # Again in every rank: under torchrun or SLURM no launcher ran the checks before.
        trainer = attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        self._run_spec = check_run(self, self.lightning_module, getattr(trainer, "datamodule", None), trainer,
                                   self.num_nodes * self.num_processes, device=self.root_device)
        add_default_callbacks(trainer, self.log_metrics, self.exit_signal_handler)
        if self._started_externally and os.environ.get(RUN_DIR_ENV):
            # A rank re-running the user's script (no launcher of its own): its run directory comes from rank 0.
            self.begin_launch(os.environ[RUN_DIR_ENV], next_run_number())
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        self.precision_plugin.device_type = self.root_device.type
        self.precision_plugin.check_device(self.root_device)
        self._layout, self._created_default_group = join_process_groups(
            self.cluster_environment, self._process_group_backend, self.root_device, self._timeout,
            self.parallel_config)
        if self._run_dir is None or self._start_method == "popen":
            # A process that goes on after the run (a script, torchrun, the launching process itself) may
            # still use the trained model's groups (generation on every TP rank after fit, as in the demo):
            # they are destroyed when the process exits, before gloo's own teardown can abort it.
            atexit.register(release_process_groups, self._layout, self._created_default_group)  # not self
        log.info("megatron-lite layout: %s", self._layout.describe())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        if trainer.state.fn == "fit" and self._run_spec is not None and self._layout is not None:
            from megatron_lite.callbacks.memory_report import report_memory_estimate

            self.memory_estimate = report_memory_estimate(self.lightning_module, trainer.datamodule, self._run_spec,
                                                          self.root_device)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.barrier()

    def model_to_device(self) -> None:
        assert self.model is not None
        if self._run_spec is not None and self._run_spec.shards_with_fsdp2 and self._layout is not None:
            # fully_shard already placed the shards on the mesh's device; Module.to() would replace
            # every DTensor parameter with a new Parameter and drop our TP metadata on it.
            return
        self.model.to(self.root_device)

    # --- collectives ----------------------------------------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        trainer = attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        if self._checkpointer_in_use is not None:
            # Before the groups go: a save in flight is committed if every rank wrote it; a failing run
            # logs its error rather than hiding the run's own.
            running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
            checkpointer, self._checkpointer_in_use, self._checkpointer_sources = self._checkpointer_in_use, None, ()
            checkpointer.close(raise_error=running)
        if self._run_dir is not None and self._start_method != "popen" and self._layout is not None:
            # A rank started by the fork/spawn launcher: hand the results back (collectives, so only on
            # the success path, where every rank gets here), then release the groups -- the process
            # ends right after.
            if trainer is not None and trainer.state.status == TrainerStatus.RUNNING:
                hand_back(self, trainer, self._run_dir)
            # Only our groups: the default one stays for whatever Lightning and the callbacks do after teardown.
            self._layout.destroy()
        super().teardown()

    def release_process_groups(self) -> None:
        """Destroy the layout's process groups, and the default one if this strategy created it. Local
        (no collective), idempotent. Called when a forked rank's run ends, and at the exit of any other
        process; the trained model cannot run collectives afterwards."""
        release_process_groups(self._layout, self._created_default_group)
        self._created_default_group = False

    def on_exception(self, exception: BaseException) -> None:
        report_rank_failure(self._failure_file, self.process_rank, exception, script_rank=self._started_externally)

    # --- the launcher's side: runs, results, failures -------------------------------------
    @property
    def process_rank(self) -> int:
        """This process's global rank, from the launcher's environment (valid before set-up)."""
        assert self.cluster_environment is not None
        return self.cluster_environment.node_rank() * self.num_processes + self.cluster_environment.local_rank()

    @property
    def failure_file(self) -> Optional[str]:
        """Where this run records its first failure (see ``rank_failure``)."""
        return self._failure_file

    def begin_launch(self, run_dir: Optional[str], sequence: int) -> None:
        """Called by the launcher: the run's directory (None once it is over) and its number."""
        self._run_dir = run_dir
        self._failure_file = failure_file(run_dir, sequence)

    def receive_results(self, trainer, run_dir: str, rank_zero_result: Any) -> Any:
        """In the launching process after the ranks finished (see ``hand_back``)."""
        return receive_results(self, trainer, run_dir, rank_zero_result)

    # --- checkpoints: Lightning's checkpoint dict to and from the Checkpointer ------------------
    @property
    def checkpoint_io(self):
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        refuse_checkpoint_io(io)  # Trainer(plugins=[SomeCheckpointIO()]) sets it here
        self._checkpoint_io = io

    def _live_layout(self) -> Optional[ParallelLayout]:
        """This rank's layout while its process groups exist (None in the launching process, or after the run)."""
        live = self._layout is not None and not self._layout.destroyed and _distributed_is_initialized()
        return self._layout if live else None

    def _megatron_optimizer(self):
        """The module's core optimizer wrapper (fp32 masters, ZeRO-1, loss scaler), if it has one."""
        module = self.lightning_module
        return module.megatron_optimizer if isinstance(module, EngineModule) else None

    def _checkpointer(self) -> Checkpointer:
        """The Checkpointer over this process's module, optimizers and layout as they are now: the same one for a
        whole run (a save in flight is waited for by the next), a new one when they changed (a forked rank, the
        next ``trainer.fit``)."""
        module = self.lightning_module
        assert module is not None
        layout = self._live_layout()
        sources = (module, layout, tuple(getattr(o, "_optimizer", o) for o in self.optimizers),
                   self._megatron_optimizer(), self.use_torch_fsdp2 and layout is not None,
                   module.run_timers() if isinstance(module, EngineModule) else None,
                   tuple(checkpoint_classes(module, attached_trainer(module))))
        if self._checkpointer_in_use is None or sources != self._checkpointer_sources:
            if self._checkpointer_in_use is not None:
                self._checkpointer_in_use.close()
            module, layout, optimizers, mopt, fsdp, timers, allowed = sources
            self._checkpointer_in_use = Checkpointer(module, layout, optimizers, megatron_optimizer=mopt,
                                                     allowed=allowed, fsdp=fsdp, timers=timers)
            self._checkpointer_sources = sources
        return self._checkpointer_in_use

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpointer().model_state()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpointer().optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # loaded in place by load_checkpoint

    def on_train_end(self) -> None:
        # The end of fit waits for the checkpoint in flight (and raises its error) before fit returns.
        self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is committed; raise its error."""
        if self._checkpointer_in_use is not None:
            self._checkpointer_in_use.wait()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) with the Checkpointer: its tensors' entries as DCP shards, the rest
        as ``meta.json``. In the background for ModelCheckpoint's saves with ``async_save=True`` (or with
        ``storage_options={"async_save": True}``)."""
        live = self._live_layout() is not None
        module = self.lightning_module
        asynchronous = saves_asynchronously(self.async_save, storage_options, live, module, attached_trainer(module))
        refuse_without_weights(module)
        path = Path(self.broadcast(str(filepath)))
        model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        if not live and not optimizer_states:
            # The launching process of a forked fit (a notebook): it holds the trained weights, the ranks
            # held the optimizer.
            rank_zero_warn("megatron-lite: this checkpoint holds the model's weights but no optimizer state (the "
                           "forked ranks kept it); resuming from it restarts the optimizer. For an exact resume "
                           "save checkpoints during fit (ModelCheckpoint).")
        self._checkpointer().save(path, checkpoint, model_state=model_state, optimizer_states=optimizer_states,
                                  asynchronous=asynchronous)

    def remove_checkpoint(self, filepath) -> None:
        """Remove a checkpoint directory (ModelCheckpoint's top-k and ``last`` replacement): renamed away at
        once, then deleted, never before a save in flight that replaces it is committed (see Checkpointer.remove)."""
        self._checkpointer().remove(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self._checkpoint_to_load(checkpoint_path)
        module = self.lightning_module
        trainer = attached_trainer(module)
        fitting = trainer is not None and trainer.state.fn == "fit"
        meta = read_meta_plain(path)
        if fitting and not holds_training_state(meta):  # every rank reads the same file: all raise together
            raise ValueError(weights_only_message(path))
        try:
            loaded = self._checkpointer().load(path, optimizers=fitting, rng=fitting, strict=module.strict_loading,
                                               verify=False, restore_cpu_rng=False)
        except EntryMismatchError as error:
            raise ValueError(mismatch_message(path, module, error.mismatch, meta)) from None
        if loaded.mismatch:
            rank_zero_warn(f"megatron-lite: strict_loading=False: loaded the entries {path} shares with the module; "
                           f"{loaded.mismatch.describe()} (the missing ones keep their current values).")
        # The global CPU generator is set right before the first step (on_train_batch_start): Lightning draws
        # from it after the load, once per DataLoader iterator it creates (its shared seed), which an
        # uninterrupted run did before the saved step.
        self._pending_cpu_rng = loaded.cpu_rng_state
        if self._auto_resume is not None and str(checkpoint_path) == self._auto_resume.requested:
            rank_zero_info(f"megatron-lite: ckpt_path='last' resumed {path} "
                           f"(global step {loaded.meta.get('global_step')})")
        return loaded.meta

    def _checkpoint_to_load(self, checkpoint_path) -> Path:
        """Before anything reads it: the path resolved (an interrupted replace recovered) and every file checked
        against the checksums written with it, on all ranks together. For ``ckpt_path="last"``: the newest
        checkpoint of the run's directories that passes, the newer ones skipped with a warning."""
        resume = self._auto_resume
        if resume is not None and str(checkpoint_path) == resume.requested:
            return resume_checkpoint(resume)
        path = resolve_checkpoint(self.broadcast(str(checkpoint_path)))
        verdict = verify_checkpoint(path)
        if verdict.status == "unverified":
            rank_zero_warn(f"megatron-lite: {path} has no manifest.json (written before checksums existed, or by "
                           f"plain DCP); its files are loaded without an integrity check.")
        return path

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._pending_cpu_rng is not None:  # the first step after a load (see load_checkpoint)
            torch.set_rng_state(self._pending_cpu_rng)
            self._pending_cpu_rng = None




STRATEGY_NAMES = {
    "megatron": "popen",  # scripts, the CLI, torchrun and SLURM
    "megatron_fork": "fork",  # notebooks and tests: ranks are forked from this process
    "megatron_spawn": "spawn",
}


def register_megatron_strategy() -> None:
    """Make ``Trainer(strategy="megatron")`` (and ``"megatron_fork"``, ``"megatron_spawn"``) resolve to
    :class:`MegatronStrategy` with that start method (idempotent)."""
    for name, start_method in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, MegatronStrategy, start_method=start_method,
                                      description=f"megatron-lite tensor/sequence/data parallelism ({start_method})")
