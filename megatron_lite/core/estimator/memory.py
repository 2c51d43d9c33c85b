"""Per-rank memory estimate of a training run: weights, gradients, optimizer state, activations.

Weights, gradients and optimizer state come from the model's real parameter tensors
(:func:`~megatron_lite.core.estimator.parameters.parameter_shapes` mirrors ``GPTModel``) times the bytes per
parameter of the precision (:data:`~megatron_lite.core.estimator.precision_bytes.PRECISION_BYTES`, the one table to
edit when precision handling changes); activations are :mod:`~megatron_lite.core.estimator.activations`'.

Under pipeline parallelism every stage gets its own estimate (:func:`estimate_stages`): the parameters of the
layers ``ParallelConfig.stage_chunks`` gives it (uneven cuts or a layout, virtual stages, the embedding on the first
stage, the output layer and a tied embedding's copy on the last), and activations per model chunk times
the chunk-microbatches its schedule keeps alive, found by walking the order the executor runs
(:func:`~megatron_lite.core.estimator.schedule_memory.schedule_memory`: 1F1B keeps ``min(P - stage, M)``,
GPipe ``M``, interleaved most on the first rank).
Checked against a real pipeline run with :class:`~megatron_lite.core.estimator.probe.ScheduleActivationProbe`.

Mixture-of-Experts layers hold the router and shared expert like dense weights and ``num_moe_experts / EP`` experts
split over ETP, replicated over expert-DP: the distributed optimizer shards the experts' state over expert-DP and
the rest over DP x CP. Their activations (:mod:`~megatron_lite.core.estimator.moe_activations`) assume balanced
routing, since a dropless layer's expert inputs depend on the data.

Under context parallelism every per-token tensor holds ``seq_length / C`` tokens, and the attention is the
blockwise context-parallel kind (:mod:`megatron_lite.core.estimator.context_parallel`): what it keeps for
backward, and the keys/values in flight and one block's scores while it runs (a transient of the forward).

A LoRA fine-tune (``EstimateLayout.lora``) holds the frozen base and its adapters as weights, but gradients, gradient
buffers, master weights and optimizer state only for the adapters (what the optimizer is built over). Activations
are the base model's: the adapters' own (their input and ``dim``-wide hidden) are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from megatron_lite.core.estimator.activations import ActivationBreakdown, activation_breakdown
from megatron_lite.core.estimator.parameters import stage_parameter_shapes
from megatron_lite.core.estimator.precision_bytes import (
    DISTRIBUTED_GRAD_BYTES,
    DISTRIBUTED_MAIN_BYTES,
    KERNEL_SAVES,
    PRECISION_BYTES,
    KernelSaves,
)
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.layout import CP_COMM_TYPES, ParallelConfig
from megatron_lite.core.parallel.pipeline_stages import PipelineLayout
from megatron_lite.core.peft.config import LoRAConfig
from megatron_lite.core.precision import normalize_precision


@dataclass
class EstimateLayout:
    """How one training run is laid out over its ranks (what the estimate depends on besides the model)."""

    micro_batch_size: int
    """Sequences per microbatch: the rows the model runs at once (the data's samples times the objective's
    ``sequences_per_sample``: a microbatch of DPO pairs holds two sequences per pair)."""
    seq_length: int
    """Tokens per sequence."""
    tensor_model_parallel_size: int = 1
    """TP size."""
    data_parallel_size: int = 1
    """DP size."""
    pipeline_model_parallel_size: int = 1
    """PP size (the estimate is made for every stage; :func:`estimate_memory` returns the most loaded)."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks (virtual stages) per pipeline rank (interleaved schedule)."""
    pipeline_schedule: Optional[str] = None
    """'1f1b', 'interleaved_1f1b' or 'gpipe'; None: the strategy's default (1f1b, interleaved with virtual stages)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers of the first pipeline stage for an uneven cut (None: an even cut)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers of the last pipeline stage for an uneven cut (None: an even cut)."""
    pipeline_model_parallel_layout: Optional[PipelineLayout] = None
    """Megatron's layout of the layers over the virtual stages (e.g. ``"E|tt|tt|L"``), instead of a cut."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence inside TP groups."""
    context_parallel_size: int = 1
    """CP size: each rank holds ``seq_length / C`` tokens of every sequence."""
    expert_model_parallel_size: int = 1
    """EP size: each rank holds ``num_moe_experts / EP`` experts of every MoE layer (folded into TP x CP x DP)."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP size: ranks that split each expert's weights; None means tensor_model_parallel_size."""
    cp_comm_type: str = "p2p"
    """How CP attention gets the other ranks' keys/values: 'p2p' (blocks passed around the ring) or 'all_gather'."""
    cp_fused_blocks: bool = True
    """CP attention's blocks run through a fused kernel (no score matrix held); False: the math path."""
    precision: str = "32-true"
    """Lightning precision string (see :data:`PRECISION_BYTES`)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (and master weights) over DP (ZeRO-1)."""
    use_torch_fsdp2: bool = False
    """Shard weights, gradients and optimizer state over DP (FSDP2, ZeRO-3; where it composes is
    :class:`~megatron_lite.core.parallel.run_spec.RunSpec`'s to check)."""
    optimizer: str = "adam"
    """'adam' (two moments) or 'sgd'."""
    sgd_momentum: float = 0.9
    """SGD momentum (0 keeps no state)."""
    num_microbatches: int = 1
    """Microbatches per optimizer step on each DP rank."""
    device_type: str = "cuda"
    """'cuda' or 'cpu': which kernels' saved tensors to assume (:data:`KERNEL_SAVES`)."""
    kernels: Optional[KernelSaves] = None
    """Overrides ``KERNEL_SAVES[device_type]`` (other attention kernels, or Korthikanti's assumptions)."""
    frozen_models: int = 0
    """Frozen copies of the model's weights the objective holds while training (a DPO/GRPO reference model)."""
    lora: Optional[LoRAConfig] = None
    """The LoRA adapters the run trains on a frozen base (the LoRA callback's configuration); None: every
    parameter trains."""

    def __post_init__(self) -> None:
        for name in (
            "micro_batch_size",
            "seq_length",
            "tensor_model_parallel_size",
            "data_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "num_microbatches",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.frozen_models, int) or isinstance(self.frozen_models, bool) or self.frozen_models < 0:
            raise ValueError(f"frozen_models must be an integer >= 0, got {self.frozen_models!r}")
        self.precision = normalize_precision(self.precision)
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.device_type not in KERNEL_SAVES:
            raise ValueError(f"device_type must be one of {sorted(KERNEL_SAVES)}, got {self.device_type!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1; set sequence_parallel=False")
        if self.seq_length % (2 * self.context_parallel_size) and self.context_parallel_size > 1:
            raise ValueError(
                f"seq_length ({self.seq_length}) must be divisible by 2 x context_parallel_size "
                f"({2 * self.context_parallel_size}); change seq_length or context_parallel_size"
            )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.sequence_parallel and self.local_seq_length % self.tensor_model_parallel_size:
            raise ValueError(
                f"seq_length ({self.seq_length}) / context_parallel_size ({self.context_parallel_size}) "
                f"must be divisible by tensor_model_parallel_size ({self.tensor_model_parallel_size}) "
                f"with sequence_parallel=True"
            )
        self.parallel_config().expert_data_parallel_size(self.world_size)  # validated as the strategy validates them

    def parallel_config(self) -> ParallelConfig:
        """The strategy's :class:`ParallelConfig` of this layout (it knows the layer cut and the schedule)."""
        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            pipeline_schedule=self.pipeline_schedule,
            num_layers_in_first_pipeline_stage=self.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=self.num_layers_in_last_pipeline_stage,
            pipeline_model_parallel_layout=self.pipeline_model_parallel_layout,
            context_parallel_size=self.context_parallel_size,
            cp_comm_type=self.cp_comm_type,
            cp_fused_blocks=self.cp_fused_blocks,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
        )

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence one rank holds (``seq_length / context_parallel_size``)."""
        return self.seq_length // self.context_parallel_size

    @property
    def world_size(self) -> int:
        """Ranks of the run: tp x cp x pp x dp."""
        return (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
            * self.data_parallel_size
        )

    @property
    def etp_size(self) -> int:
        """ETP: ranks that split each expert's weights (TP's size unless set)."""
        return self.parallel_config().etp_size

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP: copies of each expert per pipeline stage, ``TP x CP x DP / (ETP x EP)``."""
        return self.parallel_config().expert_data_parallel_size(self.world_size)

    def stage_parameter_shapes(self, config: GPTConfig, chunks: list) -> list:
        """The parameters one rank holding ``chunks`` has (TP shards, its experts split over ETP)."""
        return stage_parameter_shapes(
            config, self.tensor_model_parallel_size, chunks, self.etp_size, self.expert_model_parallel_size, self.lora
        )

    def stage_chunks(self, config: GPTConfig, pipeline_stage: int) -> list:
        """The (virtual) stages pipeline rank ``pipeline_stage`` holds, cut as ``GPTModel`` cuts them."""
        return self.parallel_config().stage_chunks(config.num_layers, pipeline_stage)


@dataclass
class MemoryEstimate:
    """Memory of one rank of one pipeline stage (:func:`estimate_memory`: the most loaded), in bytes unless said
    otherwise."""

    params: int
    """Parameters of this rank's TP/PP shard of the model (before any DP sharding), its experts included."""
    trainable_params: int
    """Of ``params``, those that train (all but a LoRA fine-tune's frozen base): gradients and optimizer state
    are theirs."""
    expert_params: int
    """Of ``params``, those of this rank's routed experts (``E / EP`` per MoE layer, split over ETP; 0 if dense)."""
    model_params: int
    """Parameters of the whole model at TP=1 (:meth:`GPTConfig.num_parameters`), every expert counted."""
    model_active_params: int
    """Parameters one token goes through (:meth:`GPTConfig.num_active_parameters`: top-k experts; FLOPs count these)."""
    weights_bytes: int
    """Parameters as held (divided over DP under FSDP2), frozen ones included."""
    grads_bytes: int
    """Gradients (of the trainable parameters)."""
    optimizer_bytes: int
    """Optimizer state (moments and master weights) with the configured optimizer sharding."""
    optimizer_bytes_replicated: int
    """Optimizer state without the distributed optimizer."""
    optimizer_bytes_distributed: int
    """Optimizer state with the distributed optimizer (sharded over DP)."""
    optimizer_host_bytes: int
    """torch's Adam keeps one fp32 step counter per tensor in host memory (counted in the total on CPU)."""
    fsdp_unsharded_bytes: int
    """FSDP2's all-gathered root unit (unsharded from forward to backward), two layers and one layer's
    gradients (not measured: FSDP needs dp > 1); 0 otherwise."""
    frozen_bytes: int
    """Weights of the frozen models the objective holds (a reference model: ``layout.frozen_models`` copies
    of this rank's shard)."""
    activation_bytes: int
    """Activation bytes at the peak (:attr:`ActivationBreakdown.peak`)."""
    total_bytes: int
    """Weights, gradients, optimizer state, activations, FSDP2 buffers and frozen models on the device."""
    pipeline_stage: int
    """The stage this estimate is for."""
    activations: ActivationBreakdown
    """Activation bytes by part."""
    layout: EstimateLayout
    """What the estimate was made for."""
    stages: list = field(default_factory=list)
    """Every pipeline stage's estimate in stage order, this one among them (set on the estimate
    :func:`estimate_memory` returns; empty on the entries themselves)."""

    @property
    def layers(self) -> list:
        """Global indices of the transformer layers this stage holds (all its chunks, in chunk order)."""
        return [c.first_layer + i for c in self.activations.chunks for i in range(c.num_layers)]

    def to_dict(self) -> dict:
        """JSON-ready summary (bytes as integers); ``stages`` lists every stage's without the shared layout."""
        skip = ("activations", "layout", "stages")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["activation_breakdown"] = asdict(self.activations)
        out["layout"] = asdict(self.layout)
        out["stages"] = [
            {k: v for k, v in stage.to_dict().items() if k not in ("layout", "stages")} for stage in self.stages
        ]
        return out


def _stage_estimate(config: GPTConfig, layout: EstimateLayout, stage: int) -> MemoryEstimate:
    dp = layout.data_parallel_size
    pb = PRECISION_BYTES[layout.precision]
    chunks = layout.stage_chunks(config, stage)
    shapes = layout.stage_parameter_shapes(config, chunks)
    num_layers = sum(len(chunk.layers) for chunk in chunks)
    params = sum(p.numel for p in shapes)
    experts = sum(p.numel for p in shapes if p.is_expert)
    # Gradients, their buffers and the optimizer's state exist for the trainable parameters only.
    trained = [p for p in shapes if p.trainable]
    trainable = sum(p.numel for p in trained)
    trainable_experts = sum(p.numel for p in trained if p.is_expert)
    moments = (2 if layout.optimizer == "adam" else int(layout.sgd_momentum > 0)) * pb.moment
    # ZeRO-1 shards each flat buffer (padded to a multiple of its group) over the ranks that hold the same
    # parameters: DP x CP for the dense ones, expert-DP for the experts (their own buckets).
    dense_group, expert_group = dp * layout.context_parallel_size, layout.expert_data_parallel_size
    dense = trainable - trainable_experts
    shard = -(-dense // dense_group) + -(-trainable_experts // expert_group)
    padded = -(-dense // dense_group) * dense_group + -(-trainable_experts // expert_group) * expert_group
    # ZeRO-1 keeps an fp32 master shard only beside half-precision weights (fp32 weights are their own main copy).
    main_bytes = DISTRIBUTED_MAIN_BYTES if pb.weight < 4 else 0
    replicated, distributed = trainable * (pb.master + moments), shard * (main_bytes + moments)
    unsharded = 0
    if layout.use_torch_fsdp2:  # every tensor split along dim 0 (rank 0 holds the rounded-up share)

        def held_of(tensors: list) -> int:
            return sum(-(-p.shape[0] // dp) * math.prod(p.shape[1:]) for p in tensors)

        held, held_trained = held_of(shapes), held_of(trained)
        weights, grads = held * pb.weight, held_trained * pb.grad
        replicated = distributed = optimizer = held_trained * (pb.master + moments)
        if dp > 1:
            layer = sum(p.numel for p in shapes if p.name.startswith("layers.")) // max(num_layers, 1)
            root = params - layer * num_layers
            unsharded = (root + 2 * layer) * pb.weight + layer * pb.grad
    elif layout.use_distributed_optimizer:
        weights, grads, optimizer = params * pb.weight, padded * DISTRIBUTED_GRAD_BYTES, distributed
    else:
        weights, grads, optimizer = params * pb.weight, trainable * pb.grad, replicated
    host = 4 * len(trained) if layout.optimizer == "adam" else 0
    acts = activation_breakdown(config, layout, stage)
    frozen = layout.frozen_models * params * pb.weight  # a plain copy of this rank's TP/PP shard, never DP-sharded
    total = weights + grads + optimizer + acts.peak + unsharded + frozen
    total += host if layout.device_type == "cpu" else 0
    return MemoryEstimate(
        params=params,
        trainable_params=trainable,
        expert_params=experts,
        model_params=config.num_parameters(),
        model_active_params=config.num_active_parameters(),
        weights_bytes=weights,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        optimizer_bytes_replicated=replicated,
        optimizer_bytes_distributed=distributed,
        optimizer_host_bytes=host,
        fsdp_unsharded_bytes=unsharded,
        frozen_bytes=frozen,
        activation_bytes=acts.peak,
        total_bytes=total,
        pipeline_stage=stage,
        activations=acts,
        layout=layout,
    )


def estimate_stages(config: GPTConfig, layout: EstimateLayout) -> list:
    """The :class:`MemoryEstimate` of a rank of every pipeline stage, in stage order."""
    config.validate_parallelism(
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.context_parallel_size,
        layout.sequence_parallel,
    )
    return [_stage_estimate(config, layout, s) for s in range(layout.pipeline_model_parallel_size)]


def estimate_memory(config: GPTConfig, layout: EstimateLayout) -> MemoryEstimate:
    """Per-rank memory of ``config`` trained with ``layout``: the pipeline stage with the largest total
    (the first such stage on a tie), with every stage's estimate in ``stages``."""
    stages = estimate_stages(config, layout)
    most = max(stages, key=lambda e: e.total_bytes)
    return dataclasses.replace(most, stages=stages)
