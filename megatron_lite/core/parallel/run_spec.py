"""The run description: what a training run is, in one frozen object built once before anything starts.

MegatronStrategy builds a :class:`RunSpec` from its options, the world size, the precision and the datamodule's
batch geometry, in the launching process and again in each rank, and hands it to every pre-launch check (the
module's, the datamodule's, the callbacks'); ``megatron-lite estimate`` builds the same one from a YAML, and the
memory estimator takes it (:func:`~megatron_lite.core.estimator.memory.estimate_for_run`). Building it checks
everything that needs no model: the sizes against the world, the batch geometry against the data-parallel size,
and where FSDP2 composes (the one place for those rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_lite.core.parallel.geometry import DataGeometry
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.precision import normalize_precision


def check_bucket_size(ddp_bucket_size: Optional[int]) -> None:
    """``ddp_bucket_size`` is None (the default size) or a positive number of elements."""
    if ddp_bucket_size is not None and (
        isinstance(ddp_bucket_size, bool) or not isinstance(ddp_bucket_size, int) or ddp_bucket_size <= 0
    ):
        raise ValueError(f"ddp_bucket_size must be a positive number of elements, got {ddp_bucket_size}")


@dataclass(frozen=True)
class RunSpec:
    """One run's layout, data geometry and numerics; validated on construction (every message names the fix)."""

    parallel: ParallelConfig
    """Tensor/sequence/pipeline/context-parallel sizes and options (Megatron's names)."""
    world_size: int
    """Ranks of the run: devices per node x nodes."""
    data: Optional[DataGeometry] = None
    """The datamodule's batch geometry (micro/global batch size, seq_length, ramp-up); None if it declares none."""
    precision: str = "32-true"
    """Lightning's precision of the run (an alias such as ``"bf16"`` is stored as ``"bf16-mixed"``)."""
    use_torch_fsdp2: bool = False
    """The strategy's ``use_torch_fsdp2``: parameters, gradients and optimizer state sharded over DP (ZeRO-3)."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient bucket (Megatron's ``--ddp-bucket-size``); None: max(40M, 1M x dp)."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket over DP during the last microbatch's backward (``--overlap-grad-reduce``)."""
    data_parallel_size: int = field(init=False)
    """Derived: ``world_size`` over the model-parallel size."""

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"RunSpec.parallel must be a ParallelConfig, got {type(self.parallel).__name__}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.data is not None and not isinstance(self.data, DataGeometry):
            raise TypeError(f"RunSpec.data must be a DataGeometry or None, got {type(self.data).__name__}")
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        check_bucket_size(self.ddp_bucket_size)
        self._check_fsdp2()
        object.__setattr__(self, "data_parallel_size", self.parallel.data_parallel_size(self.world_size))
        if self.data is not None:
            self._check_batches(self.data)

    # --- derived ---------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> Optional[int]:
        """Microbatches per optimizer step on each data-parallel rank (after any ramp-up); None without data."""
        return None if self.data is None else self.data.num_microbatches(self.data_parallel_size)

    @property
    def shards_with_fsdp2(self) -> bool:
        """Whether FSDP2 really shards: with one data-parallel rank there is nothing to shard (no hooks added)."""
        return self.use_torch_fsdp2 and self.data_parallel_size > 1

    # --- FSDP2: where it composes, all in one place -----------------------------------------
    def _check_fsdp2(self) -> None:
        if not self.use_torch_fsdp2:
            return
        precision, parallel = self.precision, self.parallel
        if precision.endswith("-true") and precision != "32-true":
            raise ValueError(
                f"use_torch_fsdp2=True with precision={precision!r}: FSDP keeps its sharded fp32 parameters as "
                f"the master weights; use precision='bf16-mixed' (or '32-true') with FSDP2."
            )
        if parallel.pipeline_model_parallel_size > 1:
            raise ValueError(
                "use_torch_fsdp2=True with pipeline_model_parallel_size > 1 is not composed yet (FSDP2 gathers and "
                "reduces in module hooks that the pipeline schedule would have to drive per stage); use the "
                "distributed optimizer, OptimizerConfig(use_distributed_optimizer=True), with pipeline parallelism."
            )
        if parallel.context_parallel_size > 1:
            raise ValueError(
                f"use_torch_fsdp2=True with context_parallel_size={parallel.context_parallel_size} is not composed yet "
                f"(FSDP2 would shard over the data-parallel ranks only, while gradients must be reduced over data x "
                f"context parallel ranks); use the distributed optimizer, OptimizerConfig(use_distributed_optimizer="
                f"True), with context parallelism."
            )
        ep, etp, tp = parallel.expert_model_parallel_size, parallel.etp_size, parallel.tensor_model_parallel_size
        if ep > 1 or etp != tp:
            raise ValueError(
                f"use_torch_fsdp2=True with expert_model_parallel_size={ep} and expert_tensor_parallel_size={etp} "
                f"(tensor_model_parallel_size={tp}) is not composed yet (FSDP2 shards and reduces every parameter over "
                f"the data-parallel ranks, while the experts of MoE layers are copied over the expert-data-parallel "
                f"ranks, a different group once EP > 1 or ETP != TP); use the distributed optimizer, OptimizerConfig("
                f"use_distributed_optimizer=True), which shards expert state over the expert-data-parallel ranks."
            )

    def check_optimizer(self, optimizer_config: Any) -> None:
        """Refuse an optimizer config this run cannot use: the distributed optimizer beside FSDP2 (both shard the
        optimizer state over the data-parallel ranks)."""
        if self.use_torch_fsdp2 and getattr(optimizer_config, "use_distributed_optimizer", False):
            raise ValueError(
                "use_torch_fsdp2=True already shards optimizer state over data-parallel ranks; set "
                "OptimizerConfig(use_distributed_optimizer=False) or drop use_torch_fsdp2."
            )

    def check_frozen_copy(self, objective: str, otherwise: str) -> None:
        """Refuse FSDP2 for ``objective``, which keeps a frozen copy of the model (a DPO/GRPO reference): that copy
        is a plain copy of the policy's TP/PP shard, which FSDP2 (sharding the policy over DP) does not give;
        ``otherwise`` completes the fix."""
        if self.use_torch_fsdp2:
            raise ValueError(
                f"{objective} does not run with use_torch_fsdp2=True (its frozen reference is a plain sharded copy of "
                f"the policy); use the distributed optimizer (model.optimizer.use_distributed_optimizer=true) for "
                f"ZeRO-1{otherwise}"
            )

    # --- batches ----------------------------------------------------------------------------
    def _check_batches(self, data: DataGeometry) -> None:
        """Every batch (each of a ramp-up included) in whole microbatches on every data-parallel rank, and in
        groups of the pipeline size under the interleaved schedule, at least two per stage under DualPipeV."""
        dp = self.data_parallel_size
        data.num_microbatches(dp)
        if data.rampup_batch_size is not None:
            data.num_microbatches_calculator(dp)
        if self.parallel.schedule not in ("interleaved_1f1b", "dualpipev"):
            return
        pp, mbs, gbs = self.parallel.pipeline_model_parallel_size, data.micro_batch_size, data.global_batch_size
        sizes = [gbs]
        if data.rampup_batch_size is not None:
            start, increment, _ = data.rampup_batch_size
            sizes = list(range(start, gbs + 1, increment)) + [gbs]
        for size in sizes:
            microbatches = size // (mbs * dp)
            if self.parallel.schedule == "dualpipev" and microbatches < 2 * pp:
                raise ValueError(
                    f"pipeline_schedule='dualpipev' needs at least 2 x pipeline_model_parallel_size ({2 * pp}) "
                    f"microbatches per step, got {microbatches} (global batch {size} / (micro_batch_size {mbs} x dp "
                    f"{dp})); raise global_batch_size to at least {2 * pp * mbs * dp} (and so every ramp-up size) or "
                    f"use pipeline_schedule='zbv'."
                )
            if (
                self.parallel.schedule == "interleaved_1f1b" and microbatches % pp
            ):  # Megatron's interleaved schedule runs microbatches in groups of pp
                raise ValueError(
                    f"the interleaved pipeline schedule needs the number of microbatches per step to be a multiple of "
                    f"pipeline_model_parallel_size ({pp}), got {microbatches} (global batch {size} / (micro_batch_size "
                    f"{mbs} x dp {dp})); set global_batch_size to a multiple of {mbs * dp * pp} (and so every "
                    f"ramp-up size) or use pipeline_schedule='1f1b'."
                )
