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
import sys
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
from megatron_lite.core.checkpoint.full.state import (
    gather_full_state,
    load_full_state,
    read_full_state,
    write_full_state,
)
from megatron_lite.core.checkpoint.resume.entries import holds_training_state, read_meta_plain
from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.estimator.flops import training_flops_per_step
from megatron_lite.core.estimator.objective_cost import objective_cost
from megatron_lite.core.estimator.report import format_table, memory_warning
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.validation import validate_run
from megatron_lite.strategies.launch_checks import (
    check_callbacks,
    check_checkpoint_fits,
    check_ckpt_path,
    ckpt_path_of,
    mismatch_message,
    weights_only_message,
)
from megatron_lite.strategies.memory_check import check_memory_fits, run_memory_estimate
from megatron_lite.strategies.precision import MegatronPrecision, as_megatron_precision
from megatron_lite.strategies.predictions import merge_predictions, write_predictions
from megatron_lite.strategies._lightning_private import (
    InPlaceLauncher,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
    attached_trainer,
    make_launcher,
    predictions_with_indices,
)
from megatron_lite.strategies.auto_resume import AutoResume, recover_interrupted_saves, replace_last, resume_checkpoint
from megatron_lite.strategies.checkpointing import (
    checkpoint_classes,
    refuse_checkpoint_io,
    refuse_without_weights,
    saves_asynchronously,
)
from megatron_lite.strategies.rank_failure import (
    RUN_DIR_ENV,
    failure_file,
    next_run_number,
    read_failure,
    record_failure,
)


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
        context_parallel_size: ranks that split every sequence (Megatron's ``--context-parallel-size``):
            the sequence is cut into ``2 x context_parallel_size`` chunks, rank r holding chunks r and
            2C-1-r (the same causal work on every rank); attention is exact (keys/values exchanged and
            the partial softmax results merged by log-sum-exp). Needs the data's ``seq_length`` divisible
            by ``2 x context_parallel_size`` (and the local length ``seq_length / context_parallel_size``
            by ``tensor_model_parallel_size`` under sequence parallelism) and ``attention_dropout=0``.
        cp_comm_type: how context-parallel attention gets the other ranks' keys and values
            (Megatron's ``--cp-comm-type``): ``"p2p"`` (passed around the CP ring, the next block in flight
            while the current one is computed; two blocks of ``seq_length / C`` tokens in memory) or
            ``"all_gather"`` (all at once: the whole sequence's keys and values in memory during attention).
        use_torch_fsdp2: shard parameters, gradients and optimizer state over the data-parallel ranks
            with PyTorch's FSDP2 (ZeRO-3), composed with TP. For ZeRO-1 (sharded optimizer state and
            fp32 masters only) set ``OptimizerConfig(use_distributed_optimizer=True)`` instead.
        ddp_bucket_size: elements per gradient bucket (Megatron's ``--ddp-bucket-size``; default
            max(40M, 1M x dp)).
        log_metrics: add a :class:`megatron_lite.callbacks.MegatronMetrics` callback (throughput, TFLOP/s,
            MFU, memory, timers, a Megatron-style console line) unless the Trainer already has one;
            ``False`` removes it.
        async_save: checkpoints saved by callbacks during ``fit`` (Lightning's ``ModelCheckpoint``) are
            written in the background: the save copies the state to host memory and returns, DCP writes
            the files in a thread, and the checkpoint is committed (renamed into place, recorded as
            latest) once every rank's files are written. The next save, the end of ``fit`` and the
            teardown wait for it, and raise its error. Other saves (``trainer.save_checkpoint`` called by
            you) stay synchronous unless called with ``storage_options={"async_save": True}``.
        overlap_grad_reduce: reduce each gradient bucket over DP (all-reduce, or reduce-scatter with
            the distributed optimizer) asynchronously during the backward of the last microbatch
            (Megatron's ``--overlap-grad-reduce``). FSDP2 always overlaps its reductions.
        check_memory: refuse a run whose estimated memory (``megatron-lite estimate``'s numbers, for the
            module's objective) exceeds what the machine has, before any process starts or weight is built:
            on CPU the ranks of this host together against its available memory, on a GPU each rank against
            its device's free memory. ``False`` skips the check (estimates can be conservative).
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
        if ddp_bucket_size is not None and ddp_bucket_size <= 0:
            raise ValueError(f"ddp_bucket_size must be a positive number of elements, got {ddp_bucket_size}")
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
        self.memory_estimate = None
        """The per-rank memory estimate logged when ``fit`` starts (a MemoryEstimate), if one could be made: the
        most loaded pipeline stage's, every stage's in ``.stages`` (this rank's: ``.stages[pp_rank]``)."""

    # --- sizes and devices ----------------------------------------------------------------
    @property
    def parallel_layout(self) -> Optional[ParallelLayout]:
        """The layout of this run (None until the process group exists)."""
        return self._layout

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
        self.validate(module, datamodule, self.num_nodes * self.num_processes, trainer)
        recover_interrupted_saves(trainer)
        check_callbacks(trainer, module)
        return self._prepare_run_args(args, kwargs, trainer)

    def _prepare_run_args(self, args: tuple, kwargs: dict, trainer) -> tuple:
        """The arguments of fit/validate/test/predict to run with: ``ckpt_path="last"`` replaced by what
        resumes the newest valid checkpoint (or None: start from the beginning), in every process that
        calls ``trainer.fit`` -- the launching process and each rank started by torchrun or SLURM."""
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        args, self._auto_resume = replace_last(args, trainer, fitting)
        return args

    def validate(self, module: Optional[LightningModule], datamodule: Optional[LightningDataModule],
                 world_size: int, trainer=None, device: Optional[torch.device] = None) -> int:
        """Check the layout against the world size, the model config, the data geometry, the
        precision, the optimizer config, the module's own checks (``validate_configuration``), the estimated
        memory against the host's (and, given a rank's CUDA ``device``, the device's) and the datamodule's
        input files (``validate_inputs``)."""
        precision = self.precision_plugin.precision  # MegatronPrecision refused unsupported ones already
        if self.use_torch_fsdp2 and precision.endswith("-true") and precision != "32-true":
            raise ValueError(
                f"use_torch_fsdp2=True with precision={precision!r}: FSDP keeps its sharded fp32 parameters as "
                f"the master weights; use precision='bf16-mixed' (or '32-true') with FSDP2.")
        engine_module = module if isinstance(module, EngineModule) else None
        optimizer_config = engine_module.optimizer_config if engine_module is not None else None
        if callable(getattr(optimizer_config, "validate", None)):
            optimizer_config.validate()  # again: a field may have been set after construction (lr=nan)
        if self.use_torch_fsdp2 and self.parallel_config.pipeline_model_parallel_size > 1:
            raise ValueError(
                "use_torch_fsdp2=True with pipeline_model_parallel_size > 1 is not composed yet (FSDP2 gathers and "
                "reduces in module hooks that the pipeline schedule would have to drive per stage); use the "
                "distributed optimizer, OptimizerConfig(use_distributed_optimizer=True), with pipeline parallelism.")
        if self.use_torch_fsdp2 and getattr(optimizer_config, "use_distributed_optimizer", False):
            raise ValueError(
                "use_torch_fsdp2=True already shards optimizer state over data-parallel ranks; set "
                "OptimizerConfig(use_distributed_optimizer=False) or drop use_torch_fsdp2.")
        if trainer is not None and engine_module is not None:
            engine_module.validate_configuration(trainer, datamodule)
        model_config = engine_module.config if engine_module is not None else None
        if model_config is not None and not hasattr(model_config, "validate_parallelism"):
            model_config = None
        dp_size = validate_run(
            self.parallel_config, world_size, model_config,
            micro_batch_size=getattr(datamodule, "micro_batch_size", None),
            global_batch_size=getattr(datamodule, "global_batch_size", None),
            seq_length=getattr(datamodule, "seq_length", None),
            rampup_batch_size=getattr(datamodule, "rampup_batch_size", None),
            use_torch_fsdp2=self.use_torch_fsdp2,
        )
        if self.check_memory:
            self._check_memory(module, datamodule, dp_size, world_size, trainer, device)
        # Last: it may read the data files. Here, in the launching process, a bad file fails once, before
        # any rank exists, instead of in a rank's setup while the others wait in a collective.
        if callable(getattr(datamodule, "validate_inputs", None)):
            datamodule.validate_inputs()
        return dp_size

    def setup_environment(self) -> None:
        super().setup_environment()
        # Again in every rank: under torchrun or SLURM no launcher ran the checks before.
        trainer = attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        self.validate(self.lightning_module, getattr(trainer, "datamodule", None), self.num_nodes * self.num_processes,
                      trainer, device=self.root_device)
        self._add_metrics_callback(trainer)
        self._add_exit_callback(trainer)
        if self._started_externally and os.environ.get(RUN_DIR_ENV):
            # A rank re-running the user's script (no launcher of its own): its run directory comes from rank 0.
            self.begin_launch(os.environ[RUN_DIR_ENV], next_run_number())
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        self.precision_plugin.device_type = self.root_device.type
        self.precision_plugin.check_device(self.root_device)
        self._created_default_group = not _distributed_is_initialized()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._layout = ParallelLayout.build(self.parallel_config, device_type=self.root_device.type,
                                            timeout=self._timeout)
        if self._run_dir is None or self._start_method == "popen":
            # A process that goes on after the run (a script, torchrun, the launching process itself) may
            # still use the trained model's groups (generation on every TP rank after fit, as in the demo):
            # they are destroyed when the process exits, before gloo's own teardown can abort it.
            atexit.register(_release, self._layout, self._created_default_group)  # not self: keeps the model alive
        log.info("megatron-lite layout: %s", self._layout.describe())

    def _add_metrics_callback(self, trainer) -> None:
        # Here, in every rank before Lightning calls the callbacks' setup: the timers' gather is a
        # collective, so every rank needs the callback.
        from megatron_lite.callbacks import MegatronMetrics

        if self.log_metrics and trainer is not None and not any(isinstance(c, MegatronMetrics) for c in trainer.callbacks):
            trainer.callbacks.append(MegatronMetrics())

    def _add_exit_callback(self, trainer) -> None:
        # Every rank needs it: the ranks agree on stopping with a collective at each step boundary.
        from megatron_lite.callbacks.graceful_exit import GracefulExit

        if self.exit_signal_handler and trainer is not None and trainer.checkpoint_callback is not None and \
                not any(isinstance(c, GracefulExit) for c in trainer.callbacks):
            trainer.callbacks.append(GracefulExit())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        if trainer.state.fn == "fit":
            self.memory_estimate = self._log_memory_estimate(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.barrier()

    def _check_memory(self, module, datamodule, dp_size: int, world_size: int, trainer,
                      device: Optional[torch.device]) -> None:
        """Refuse the run before anything is allocated when its estimate exceeds the machine (see memory_check)."""
        device_type = device.type if device is not None else (
            self.parallel_devices[0].type if self.parallel_devices else "cpu")
        try:
            estimate = run_memory_estimate(module, datamodule, self.parallel_config, dp_size,
                                           self.precision_plugin.precision, self.use_torch_fsdp2, device_type)
        except (ValueError, TypeError):
            return  # no estimate: nothing to compare (the start-up report says why)
        if estimate is not None:
            fitting = trainer is None or trainer.state.fn in (None, TrainerFn.FITTING)
            check_memory_fits(estimate, fitting=fitting, device_type=device_type,
                              ranks_on_host=max(self.num_processes, 1), world_size=world_size, device=device)

    def _log_memory_estimate(self, trainer):
        """Megatron-style start-up report: per-rank memory and FLOPs per step from the configs, with a
        warning when it exceeds the device's memory. Never stops a run: an estimate it cannot make is
        a warning."""
        module, datamodule = self.lightning_module, getattr(trainer, "datamodule", None)
        if self._layout is None:
            return None
        layout = self._layout
        try:
            estimate = run_memory_estimate(module, datamodule, layout.config, layout.dp_size,
                                           self.precision_plugin.precision, self.use_torch_fsdp2,
                                           self.root_device.type)
            if estimate is None:
                return None
            flops = training_flops_per_step(module.config, datamodule.global_batch_size, datamodule.seq_length,
                                            tensor_model_parallel_size=layout.tp_size,
                                            cost=objective_cost(module, datamodule))
        except (ValueError, TypeError) as error:
            rank_zero_warn(f"megatron-lite: no memory estimate for this run ({error})")
            return None
        rank_zero_info("megatron-lite memory estimate (before the first step):\n" + format_table(estimate, flops))
        total = torch.cuda.get_device_properties(self.root_device).total_memory \
            if self.root_device.type == "cuda" else None
        warning = memory_warning(estimate, total)
        if warning:
            rank_zero_warn(warning)
        return estimate

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.use_torch_fsdp2 and self._layout is not None and self._layout.dp_size > 1:
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
                self._hand_back(trainer, self._run_dir)
            # Only our groups: the default one stays for whatever Lightning and the callbacks do after teardown.
            self._layout.destroy()
        super().teardown()

    def release_process_groups(self) -> None:
        """Destroy the layout's process groups, and the default one if this strategy created it. Local
        (no collective), idempotent. Called when a forked rank's run ends, and at the exit of any other
        process; the trained model cannot run collectives afterwards."""
        _release(self._layout, self._created_default_group)
        self._created_default_group = False

    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SystemExit):
            return  # a deliberate exit that every rank agreed on (e.g. code 16 of the rerun policy): not a failure
        # Before the teardown closes this rank's connections: a peer's collective error comes after.
        rank = self.process_rank
        record_failure(self._failure_file, rank, exception)
        record = read_failure(self._failure_file)
        if self._started_externally and rank != 0 and record is not None and record["rank"] != rank:
            # A rank re-running the user's script whose error is a consequence of another rank's (a
            # collective that lost its peer): the failing rank and rank 0 report it, this one exits quietly.
            sys.stderr.flush()
            os._exit(1)

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

    def _hand_back(self, trainer, run_dir: str) -> None:
        """In every rank: after fit, the whole model as full tensors (one file per distinct piece); after
        predict, this replica's predictions with their sample indices."""
        assert self._layout is not None and self.lightning_module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            state = gather_full_state(self.lightning_module, self._layout, substitutes=self._master_weights())
            if state is not None:
                os.makedirs(os.path.join(run_dir, "model"), exist_ok=True)
                write_full_state(state, os.path.join(run_dir, "model"), self.global_rank)
        elif trainer.state.fn == TrainerFn.PREDICTING and trainer.predict_loop.return_predictions:
            layout = self._layout
            if layout.tp_rank == 0 and layout.cp_rank == 0 and layout.is_last_pipeline_stage:
                os.makedirs(os.path.join(run_dir, "predictions"), exist_ok=True)
                write_predictions(predictions_with_indices(trainer), layout,
                                   os.path.join(run_dir, "predictions", f"rank{self.global_rank:05d}.safetensors"))

    def _master_weights(self) -> dict[str, Tensor]:
        """The optimizer's fp32 masters of a half-precision (``bf16-true``/``16-true``) model, by the module's
        parameter names: what training arrived at, of which the model holds a rounded copy. Collective under the
        distributed optimizer (gathered over DP)."""
        mopt = self._megatron_optimizer()
        if mopt is None:
            return {}
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        params = dict(mopt.named_params)
        # a parameter the module no longer has (distillation projections taken off at the end) is not handed back
        return {names[id(params[n])]: master for n, master in mopt.master_weights().items() if id(params[n]) in names}

    def receive_results(self, trainer, run_dir: str, rank_zero_result: Any) -> Any:
        """In the launching process after the ranks finished: load the handed-back model into the module
        (after fit) and return what ``trainer.<fn>`` should (the merged predictions after predict)."""
        if trainer.state.fn == TrainerFn.FITTING:
            self._receive_model(os.path.join(run_dir, "model"))
        if trainer.state.fn == TrainerFn.PREDICTING:  # files only where the ranks kept predictions
            return merge_predictions(os.path.join(run_dir, "predictions"), rank_zero_result)
        return rank_zero_result

    def _receive_model(self, directory: str) -> None:
        module = self.lightning_module
        assert module is not None
        try:
            state = read_full_state(directory)
            loader = getattr(module, "load_full_state_dict", None)
            if callable(loader):
                loader(state)
            else:
                load_full_state(module, state)
        except (ValueError, FileNotFoundError) as error:
            message = (
                f"the trained weights of {type(module).__name__} could not be handed back from the forked ranks "
                f"({error}); validate/test/predict/save_checkpoint here would use stale weights, so they are "
                f"refused. Build the model in __init__, or give the module a load_full_state_dict(state) method "
                f"that builds it (GPTModule has one), or save checkpoints during fit (ModelCheckpoint) and pass "
                f"ckpt_path=...")
            module._megatron_lite_weights_missing = message
            rank_zero_warn(message)
            return
        module._megatron_lite_weights_missing = None

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


def _release(layout: Optional[ParallelLayout], default_group: bool) -> None:
    if layout is not None:
        layout.destroy()
    if default_group and _distributed_is_initialized():
        torch.distributed.destroy_process_group()


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
