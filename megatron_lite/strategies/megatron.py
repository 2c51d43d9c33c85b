"""MegatronStrategy: Megatron-style tensor, sequence, pipeline, context and data parallelism for Lightning's Trainer.

The strategy itself is Lightning's properties (devices, ranks, how data splits over DP ranks), the set-up (the process
groups and the :class:`ParallelLayout`) and the collectives. Its options are ``options.py``'s dataclass; launching and
the checks before it its launch half (``launch.py``); distributed checkpoints its checkpoint half
(``checkpointing.py``). The training step (schedule, gradient reduction, clipping) is ``megatron_lite.core``'s, driven
by the LightningModule (see :class:`megatron_lite.GPTModule`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.strategies._lightning_private import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
    attached_trainer,
)
from megatron_lite.strategies.checkpointing import StrategyCheckpoints, refuse_checkpoint_io
from megatron_lite.strategies.hand_back import hand_back
from megatron_lite.strategies.launch import StrategyLaunch
from megatron_lite.strategies.options import StartMethod, StrategyOptions
from megatron_lite.strategies.precision import MegatronPrecision, as_megatron_precision
from megatron_lite.strategies.process_groups import join_process_groups, release_process_groups
from megatron_lite.strategies.rank_failure import report_rank_failure

log = logging.getLogger(__name__)


class MegatronStrategy(ParallelStrategy):
    """Tensor (+ sequence), pipeline, context and data parallelism with Megatron's argument names.

    Args:
        tensor_model_parallel_size: ranks that split every layer's weights (heads, FFN, vocabulary).
        sequence_parallel: shard LayerNorm/dropout activations along the sequence inside TP groups.
        pipeline_model_parallel_size: ranks that split the layers into consecutive stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved schedule).
        pipeline_schedule: ``"1f1b"`` (default), ``"interleaved_1f1b"`` (default with virtual stages), ``"gpipe"`` or
            ``"zb1p"`` (zero-bubble ZB-H1: split backward, a third of 1F1B's bubble at 1F1B's peak memory).
        num_layers_in_first_pipeline_stage: layers of the first stage for an uneven cut.
        num_layers_in_last_pipeline_stage: layers of the last stage for an uneven cut.
        pipeline_model_parallel_layout: Megatron's layout of the layers over the ``P x V`` virtual stages instead of
            a cut, e.g. ``"E|tt|tt|L"`` (the embedding and the loss alone on the end stages) or one list of layer
            names per stage; see docs/pipelines.md.
        context_parallel_size: ranks that split every sequence into ``2 x C`` chunks (exact attention); needs
            ``seq_length`` divisible by ``2 x C`` (``2 x C x TP`` with sequence parallelism), ``attention_dropout=0``.
        cp_comm_type: how CP attention gets the other ranks' keys and values: ``"p2p"`` (around the ring, one block in
            flight) or ``"all_gather"`` (the whole sequence's at once).
        cp_fused_blocks: CP attention computes its blocks with a fused kernel that returns the log-sum-exp (CPU: torch's
            flash kernel; CUDA: the memory-efficient SDPA kernel); ``False`` runs the math path that holds each block's
            scores (slower, more memory; for debugging).
        expert_model_parallel_size: ranks that split the experts of an MoE model (EP), folded into TP x CP x DP: the
            experts of a stage run on ETP x EP x EDP of the same ranks (Megatron's MoE parallel folding).
        expert_tensor_parallel_size: ranks that split each expert's weights (ETP); None means
            ``tensor_model_parallel_size``.
        use_torch_fsdp2: shard parameters, gradients and optimizer state over the DP ranks with PyTorch's FSDP2
            (ZeRO-3), composed with TP; for ZeRO-1 set ``OptimizerConfig(use_distributed_optimizer=True)`` instead.
        ddp_bucket_size: elements per gradient bucket (Megatron's ``--ddp-bucket-size``; default max(40M, 1M x dp)).
        overlap_grad_reduce: reduce each gradient bucket over DP during the backward of the last microbatch
            (Megatron's ``--overlap-grad-reduce``; FSDP2 always overlaps its reductions).
        log_metrics: add a :class:`megatron_lite.callbacks.MegatronMetrics` (throughput, MFU, memory, timers, Megatron's
            console line) unless the Trainer has one.
        exit_signal_handler: add a :class:`megatron_lite.callbacks.GracefulExit` (on SIGTERM save ``last.ckpt`` and
            stop) where the Trainer has a checkpoint callback and no GracefulExit.
        async_save: write the checkpoint callbacks' saves during ``fit`` in the background; the next save, the end of
            fit and teardown wait for each (and raise its error).
        check_memory: refuse a run whose estimated memory (``megatron-lite estimate``'s) exceeds the host's or a GPU's
            free memory, before anything is built.
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA by default.
        timeout: how long a collective of any of the run's process groups (the layout's too) waits for its peers.
        start_method: ``"popen"`` (re-run the script per rank: scripts, the CLI), ``"fork"`` (notebooks, tests) or
            ``"spawn"``; ignored under torchrun / SLURM. Forked/spawned ranks hand the trained model, the metrics, the
            loop's progress and the predictions back to this process; a rank's exception is raised here.
        checkpoint_io: refused (also in ``Trainer(plugins=...)``): the strategy writes its checkpoints itself.
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
        pipeline_model_parallel_layout: Optional[Union[str, list[list[str]]]] = None,
        context_parallel_size: int = 1,
        cp_comm_type: str = "p2p",
        cp_fused_blocks: bool = True,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: Optional[int] = None,
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = StrategyOptions(
            parallel=ParallelConfig(
                tensor_model_parallel_size=tensor_model_parallel_size,
                sequence_parallel=sequence_parallel,
                pipeline_model_parallel_size=pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                pipeline_schedule=pipeline_schedule,
                num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                pipeline_model_parallel_layout=pipeline_model_parallel_layout,
                context_parallel_size=context_parallel_size,
                cp_comm_type=cp_comm_type,
                cp_fused_blocks=cp_fused_blocks,
                expert_model_parallel_size=expert_model_parallel_size,
                expert_tensor_parallel_size=expert_tensor_parallel_size,
            ),
            use_torch_fsdp2=use_torch_fsdp2,
            ddp_bucket_size=ddp_bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            log_metrics=log_metrics,
            exit_signal_handler=exit_signal_handler,
            async_save=async_save,
            check_memory=check_memory,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.launch = StrategyLaunch(self)
        """The launch half: the launcher, the checks before it, the run's directory (see ``launch.py``)."""
        self.checkpoints = StrategyCheckpoints(self)
        """The checkpoint half: Lightning's checkpoint dicts to and from the run's Checkpointer."""
        self._num_nodes = 1
        self._process_group_backend = process_group_backend  # resolved for the device in setup_environment
        self._layout: Optional[ParallelLayout] = None
        self._created_default_group = False
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
        return self.launch.run_spec

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
            parallel = self.options.parallel
            dp = parallel.data_parallel_size(self.num_nodes * self.num_processes)
            return {"num_replicas": dp, "rank": self.global_rank // parallel.model_parallel_size}
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
        self._launcher = self.launch.launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        self.launch.check_rank(attached_trainer(self.lightning_module))
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self.precision_plugin.device_type = self.root_device.type
        self.precision_plugin.check_device(self.root_device)
        self._layout, self._created_default_group = join_process_groups(
            self.cluster_environment,
            self._process_group_backend,
            self.root_device,
            self.options.timeout,
            self.options.parallel,
            release_at_exit=not self.launch.forked,
        )
        log.info("megatron-lite layout: %s", self._layout.describe())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        if trainer.state.fn == "fit" and self.run_spec is not None and self._layout is not None:
            from megatron_lite.callbacks.memory_report import report_memory_estimate

            self.memory_estimate = report_memory_estimate(
                self.lightning_module, trainer.datamodule, self.run_spec, self.root_device
            )
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.barrier()

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.run_spec is not None and self.run_spec.shards_with_fsdp2 and self._layout is not None:
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

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # --- the end of a run -----------------------------------------------------------------
    def teardown(self) -> None:
        trainer = attached_trainer(self.lightning_module)
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        self.checkpoints.close(raise_error=running)  # before the groups go
        if self.launch.forked and self._layout is not None:
            # A rank started by the fork/spawn launcher: hand the results back (collectives, so only on
            # the success path, where every rank gets here), then release the groups -- the process
            # ends right after.
            if running:
                hand_back(self, trainer, self.launch.run_dir)
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
        report_rank_failure(
            self.launch.failure_file, self.launch.process_rank, exception, script_rank=self.launch.started_externally
        )

    # --- checkpoints: the hooks Lightning calls, answered by the checkpoint half ---------------
    @property
    def checkpoint_io(self):
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        refuse_checkpoint_io(io)  # Trainer(plugins=[SomeCheckpointIO()]) sets it here
        self._checkpoint_io = io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.checkpointer().model_state()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self.checkpoints.checkpointer().optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # loaded in place by load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """A distributed checkpoint; in the background for ModelCheckpoint's saves with ``async_save=True`` (or with
        ``storage_options={"async_save": True}``)."""
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath) -> None:
        """Remove a checkpoint directory (ModelCheckpoint's top-k and ``last`` replacement), never before a save in
        flight that replaces it is committed (see Checkpointer.remove)."""
        self.checkpoints.checkpointer().remove(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint into the module (and in ``fit`` the optimizers and RNG states) in place, after checking
        every file against its checksums; ``ckpt_path="last"``: the newest valid one of the run's directories."""
        return self.checkpoints.load(checkpoint_path, self.launch.auto_resume)

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is committed; raise its error."""
        self.checkpoints.wait()

    def on_train_end(self) -> None:
        # The end of fit waits for the checkpoint in flight (and raises its error) before fit returns.
        self.checkpoints.wait()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.checkpoints.restore_cpu_rng()  # the first step after a load (see load_checkpoint)


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
            StrategyRegistry.register(
                name,
                MegatronStrategy,
                start_method=start_method,
                description=f"megatron-lite tensor/sequence/data parallelism ({start_method})",
            )
