"""Per-rank memory estimate of a training run: weights, gradients, optimizer state, activations.

Weights, gradients and optimizer state come from the model's real parameter tensors (:func:`parameter_shapes`
mirrors ``GPTModel``: TP shards, padded vocabulary, replicated norms and row-parallel biases) times the bytes
per parameter of the precision (:data:`~megatron_lite.core.estimator.precision_bytes.PRECISION_BYTES`, the one
table to edit when precision handling changes).

Activations follow Korthikanti et al. 2022: add up, layer by layer, every tensor autograd keeps for the
backward. Their ``s b h (34 + 5 a s/h)`` assumes GPT-3 blocks in 16-bit (``korthikanti_activation_bytes_per_layer``);
:func:`activation_breakdown` applies the same accounting to what this model really keeps (RMSNorm/LayerNorm,
SwiGLU/GeLU, GQA, RoPE, ``v`` as a view of the fused QKV output, flash attention without ``s x s`` scores, the
fp32 residual stream and bf16 weight copies of autocast, the fp32 softmax of the loss, recompute), checked
against :mod:`megatron_lite.core.estimator.probe` on CPU and on an H200.

Under pipeline parallelism every stage gets its own estimate (:func:`estimate_stages`): the parameters of the
layers ``ParallelConfig.stage_chunks`` gives it (uneven cuts, virtual stages, the embedding on the first
stage, the output layer and a tied embedding's copy on the last), and activations per model chunk times
the chunk-microbatches its schedule keeps alive, found by walking the order the executor runs
(:func:`~megatron_lite.core.estimator.schedule_memory.schedule_memory`: 1F1B keeps ``min(P - stage, M)``,
GPipe ``M``, interleaved most on the first rank).
Checked against a real pipeline run with :class:`~megatron_lite.core.estimator.probe.ScheduleActivationProbe`.

Under context parallelism every per-token tensor holds ``seq_length / C`` tokens, and the attention is the
blockwise context-parallel kind (:mod:`megatron_lite.core.estimator.context_parallel`): what it keeps for
backward, and the keys/values in flight and one block's scores while it runs (a transient of the forward).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from megatron_lite.core.estimator.context_parallel import (
    context_parallel_attention_parts,
    context_parallel_attention_transient,
    layer_bytes_until_attention,
)
from megatron_lite.core.estimator.precision_bytes import (
    DISTRIBUTED_GRAD_BYTES,
    DISTRIBUTED_MAIN_BYTES,
    KERNEL_SAVES,
    PRECISION_BYTES,
    KernelSaves,
    normalize_precision,
)
from megatron_lite.core.estimator.schedule_memory import ChunkActivations, schedule_memory
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.recompute import full_recompute_groups
from megatron_lite.core.parallel.layout import CP_COMM_TYPES, ParallelConfig
from megatron_lite.core.parallel.pipeline.schedules import schedule_order


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
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence inside TP groups."""
    context_parallel_size: int = 1
    """CP size: each rank holds ``seq_length / C`` tokens of every sequence."""
    cp_comm_type: str = "p2p"
    """How CP attention gets the other ranks' keys/values: 'p2p' (blocks passed around the ring) or 'all_gather'."""
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

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "seq_length", "tensor_model_parallel_size", "data_parallel_size",
                     "pipeline_model_parallel_size", "context_parallel_size", "num_microbatches"):
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
            raise ValueError(f"seq_length ({self.seq_length}) must be divisible by 2 x context_parallel_size "
                             f"({2 * self.context_parallel_size}); change seq_length or context_parallel_size")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.sequence_parallel and self.local_seq_length % self.tensor_model_parallel_size:
            raise ValueError(f"seq_length ({self.seq_length}) / context_parallel_size ({self.context_parallel_size}) "
                             f"must be divisible by tensor_model_parallel_size ({self.tensor_model_parallel_size}) "
                             f"with sequence_parallel=True")
        self.parallel_config()  # the pipeline options, validated as the strategy validates them

    def parallel_config(self) -> ParallelConfig:
        """The strategy's :class:`ParallelConfig` of this layout (it knows the layer cut and the schedule)."""
        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size, sequence_parallel=self.sequence_parallel,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            pipeline_schedule=self.pipeline_schedule,
            num_layers_in_first_pipeline_stage=self.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=self.num_layers_in_last_pipeline_stage,
            context_parallel_size=self.context_parallel_size, cp_comm_type=self.cp_comm_type)

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence one rank holds (``seq_length / context_parallel_size``)."""
        return self.seq_length // self.context_parallel_size

    @property
    def world_size(self) -> int:
        """Ranks of the run: tp x cp x pp x dp."""
        return (self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size
                * self.data_parallel_size)

    def stage_chunks(self, config: GPTConfig, pipeline_stage: int) -> list:
        """The (virtual) stages pipeline rank ``pipeline_stage`` holds, cut as ``GPTModel`` cuts them."""
        return self.parallel_config().stage_chunks(config.num_layers, pipeline_stage)


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor as a rank holds it."""

    name: str
    """Name in ``GPTModel.named_parameters()``."""
    shape: tuple
    """Local (per-rank) shape."""
    is_matmul_weight: bool
    """Multiplied as a matrix (autocast keeps a low-precision copy of it during the step)."""

    @property
    def numel(self) -> int:
        """Elements of the local tensor."""
        return math.prod(self.shape)


def parameter_shapes(config: GPTConfig, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                     pipeline_stage: int = 0, *, virtual_pipeline_model_parallel_size: int = 1,
                     num_layers_in_first_pipeline_stage: Optional[int] = None,
                     num_layers_in_last_pipeline_stage: Optional[int] = None) -> list:
    """The :class:`ParamShape` of every parameter one rank of pipeline rank ``pipeline_stage`` holds, in the
    order of ``GPTModel.named_parameters()``.

    The layers are cut as ``GPTModel`` cuts them (:meth:`ParallelConfig.stage_chunks`: uneven first/last
    stages, ``V`` virtual stages per rank). The first stage holds the embedding, the last the final norm
    and the output layer; with tied embeddings the last stage keeps its own copy of the word embedding
    (Megatron's), which the output layer multiplies by.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    config.validate_parallelism(tp, pp)
    cut = ParallelConfig(pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                         num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                         num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage)
    return _stage_parameter_shapes(config, tp, cut.stage_chunks(config.num_layers, pipeline_stage))


def _stage_parameter_shapes(config: GPTConfig, tp: int, chunks: list) -> list:
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    vocab = config.padded_vocab_size(tp)
    qkv = d * (config.num_attention_heads + 2 * config.num_query_groups)
    fc1 = f * (2 if config.activation == "swiglu" else 1)
    first = any(chunk.pre_process for chunk in chunks)
    last = any(chunk.post_process for chunk in chunks)
    tied = config.share_embeddings_and_output_weights
    out: list = []

    def norm(prefix: str) -> None:
        out.append(ParamShape(f"{prefix}.weight", (h,), False))
        if config.normalization == "LayerNorm":
            out.append(ParamShape(f"{prefix}.bias", (h,), False))

    def linear(prefix: str, rows: int, cols: int, bias: Optional[tuple]) -> None:
        out.append(ParamShape(f"{prefix}.weight", (rows, cols), True))
        if bias is not None:
            out.append(ParamShape(f"{prefix}.bias", bias, False))

    bias = config.add_bias_linear
    if first or (last and tied):
        # A lookup on the first stage; on the last stage of tied embeddings the output layer's matrix.
        out.append(ParamShape("embedding.weight", (vocab // tp, h), last and tied))
    if first and config.position_embedding_type == "learned_absolute":
        out.append(ParamShape("position_embeddings.weight", (config.max_position_embeddings, h), False))
    for i in (i for chunk in chunks for i in chunk.layers):
        p = f"layers.{i}"
        norm(f"{p}.input_layernorm")
        # Column-parallel: output rows (and bias) split; row-parallel: input columns split, bias replicated.
        linear(f"{p}.self_attention.linear_qkv", qkv // tp, h,
               (qkv // tp,) if bias or config.add_qkv_bias else None)
        linear(f"{p}.self_attention.linear_proj", h, config.num_attention_heads * d // tp, (h,) if bias else None)
        norm(f"{p}.pre_mlp_layernorm")
        linear(f"{p}.mlp.linear_fc1", fc1 // tp, h, (fc1 // tp,) if bias else None)
        linear(f"{p}.mlp.linear_fc2", h, f // tp, (h,) if bias else None)
    if last:
        norm("final_layernorm")
        if not tied:
            out.append(ParamShape("output_layer.weight", (vocab // tp, h), True))
    return out


@dataclass
class ActivationBreakdown:
    """Bytes one rank keeps for backward, by part (one microbatch unless said otherwise)."""

    embedding: int = 0
    """Shard-local token ids (TP), position ids, embedding dropout mask, rotary tables (not the batch)."""
    per_layer: int = 0
    """One transformer layer (selective recompute applied; full recompute rebuilds this per layer)."""
    layers: int = 0
    """All layers of this rank's chunks for one microbatch, with the recompute setting applied."""
    output: int = 0
    """Final norm, output-layer input and the fp32 softmax the loss keeps."""
    microbatches_in_flight: int = 1
    """Chunk-microbatches alive at once when the most is held (1 without pipelining; 1F1B: ``min(P - stage, M)``;
    interleaved: counted per chunk, see :attr:`chunks`)."""
    recompute_working_set: int = 0
    """Extra bytes at the backward's peak while a recomputed chunk is rebuilt (once, not per microbatch)."""
    loss_transient: int = 0
    """Extra bytes while the loss is computed: the logits and their max-shifted fp32 copy beside the kept
    softmax (once; the forward's peak, measured on an H200)."""
    autocast_weight_copies: int = 0
    """Autocast's low-precision copies of the matmul weights, kept until backward (once per step)."""
    pipeline_buffers: int = 0
    """Activations sent to the next stage and gradients sent to the previous one, still held by their
    posted sends when the most is held (0 without pipelining)."""
    held_after_forward: int = 0
    """The most bytes the forwards hold for the backwards at once over the schedule, pipeline buffers and
    autocast copies included (what the probe measures after a forward)."""
    peak: int = 0
    """Peak activation bytes: the held bytes plus the loss computation of a forward or a chunk rebuilt by a
    backward, at the schedule's worst moment."""
    recompute: str = "none"
    """The recompute setting applied, in words."""
    chunks: list = field(default_factory=list)
    """Per model chunk held by the rank (:class:`ChunkActivations`), in chunk order."""
    parts: dict = field(default_factory=dict)
    """Per-layer bytes by tensor (for reports and tests)."""

    @property
    def total(self) -> int:
        """Held after the forward plus the chunk rebuilt by recompute (the backward's peak)."""
        return self.held_after_forward + self.recompute_working_set


def _layer_parts(config: GPTConfig, layout: EstimateLayout, selective: bool = False) -> dict:
    """Bytes one layer saves, by tensor, for one microbatch on one rank (see the module docstring)."""
    tp, pb = layout.tensor_model_parallel_size, PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    s, b, h, d = layout.local_seq_length, layout.micro_batch_size, config.hidden_size, config.kv_channels
    tokens = s * b  # inside TP regions every rank sees the whole (CP-local) sequence ...
    local = tokens // tp if layout.sequence_parallel else tokens  # ... the residual stream may be split
    c, r = pb.compute, pb.residual
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    ffn = config.ffn_hidden_size // tp
    gqa, rope = heads != groups, config.position_embedding_type == "rope"
    math_attention = config.attention_dropout > 0 and kernels.attention_dropout_materializes_scores

    def mask(element_bytes: int) -> int:
        return kernels.dropout_mask_bytes or element_bytes

    parts = {"norms": 2 * _norm_bytes(config, kernels, local * h, r)}
    parts["linear_inputs"] = 2 * tokens * h * c  # QKV and fc1 inputs, all-gathered under SP
    # q, k, v as the attention kernel keeps them: RoPE makes new q and k, cutting q out of GQA groups
    # copies it, GQA repeats k and v to every head, and whatever is still a view keeps the whole fused
    # QKV output alive. Under selective recompute the checkpoint keeps q, k, v before the GQA repeat
    # (v is then always a view) and everything inside the kernel is rebuilt in backward.
    qkv_out = tokens * (heads + 2 * groups) * d * c
    q = tokens * heads * d * c if rope or gqa else None
    k = tokens * (groups if selective else heads) * d * c if rope or (gqa and not selective) else None
    v = tokens * heads * d * c if gqa and not selective else None
    dense = 4 if kernels.dense_attention_in_fp32 else c
    if math_attention and not selective:  # the dense kernel keeps scaled copies of q, k (and an upcast v)
        q = k = tokens * heads * d * dense
        v = tokens * heads * d * dense if dense != c else v
    parts["qkv"] = sum(x for x in (q, k, v) if x is not None) + (qkv_out if None in (q, k, v) else 0)
    attn_out = tokens * heads * d * c
    if selective or math_attention:
        parts["attention_out"] = attn_out  # the projection's input
        if not selective:
            # softmax, dropout mask, dropped probabilities
            parts["attention_scores"] = b * heads * s * s * (2 * dense + mask(dense))
    else:
        copied = c == 4 and b > 1 and kernels.fp32_attention_output_is_copied
        parts["attention_out"] = attn_out * (2 if copied else 1)  # output = (or copied into) the projection's input
        parts["logsumexp"] = b * heads * s * 4 + kernels.attention_rng_bytes
    if layout.context_parallel_size > 1 and not selective:
        parts.update(context_parallel_attention_parts(config, layout, c, rope=rope, gqa=gqa))
    gated = config.activation == "swiglu"
    parts["mlp"] = tokens * ffn * c * (4 if gated else 2)  # fc1 output, [silu output, product | gelu output]
    if config.hidden_dropout > 0:
        branch = r if config.add_bias_linear else c  # an fp32 bias promotes the branch to fp32
        parts["dropout_masks"] = 2 * local * h * mask(branch)
    return parts


def _norm_bytes(config: GPTConfig, kernels: KernelSaves, elements: int, element_bytes: int) -> int:
    """A norm keeps its input and fp32 statistics (rstd; LayerNorm also the mean), CPU's RMSNorm also ``x * rstd``."""
    stats = elements // config.hidden_size * 4 * (2 if config.normalization == "LayerNorm" else 1)
    normalized = config.normalization == "RMSNorm" and kernels.rms_norm_saves_normalized
    return elements * element_bytes * (2 if normalized else 1) + stats


def _rope_bytes(config: GPTConfig, layout: EstimateLayout, stored_layers: int, tables_held: bool) -> int:
    """cos/sin tables: fp32 attention shares them; 16-bit attention casts a copy per rotation of q and k
    in every layer that stores its activations; checkpointed layers hold the fp32 tables as inputs."""
    if config.position_embedding_type != "rope":
        return 0
    rot = int(config.kv_channels * config.rotary_percent)
    rot -= rot % 2
    # Under CP the positions come per sample ([b, s/C], the zigzag share's), and so do the tables.
    rows = layout.local_seq_length * (layout.micro_batch_size if layout.context_parallel_size > 1 else 1)
    tables = 2 * rows * rot * 4
    c = PRECISION_BYTES[layout.precision].compute
    if c == 4:
        return tables if stored_layers or tables_held else 0
    return stored_layers * 4 * rows * rot * c + (tables if tables_held else 0)


def _recompute_groups(config: GPTConfig, stage_layers: int) -> tuple:
    """([(layer count, recomputed?)] in forward order, description), grouped as ``GPTModel`` groups its
    layers for 'full' recompute; 'selective' checkpoints only the core attention (see :func:`_layer_parts`)."""
    groups = [(len(positions), checkpointed) for positions, checkpointed in full_recompute_groups(config, stage_layers)]
    k = config.recompute_num_layers
    if config.recompute_granularity != "full":
        return groups, "selective (core attention)" if config.recompute_granularity else "none"
    if config.recompute_method == "block":
        return groups, f"full, block: first {min(k, stage_layers)} of {stage_layers} layers"
    return groups, f"full, uniform: chunks of {k} layer(s)"


def activation_breakdown(config: GPTConfig, layout: EstimateLayout, pipeline_stage: int = 0) -> ActivationBreakdown:
    """Activation bytes of one rank of pipeline rank ``pipeline_stage`` (see the module docstring).

    Each model chunk the rank holds keeps its layers' share per microbatch (plus the embedding's on the
    first chunk, the loss's on the last); the schedule decides how many chunk-microbatches are alive at
    once, found by walking its order (:func:`schedule_memory`). A recomputed group keeps only its input;
    in backward it is rebuilt in full while the groups before it still hold their inputs (the output
    layer's activations are freed by then), which may exceed what the forward kept (``recompute_working_set``).
    The forward peaks while the loss is computed (``loss_transient``); transients of the backward
    (activation gradients) are not counted.
    """
    tp = layout.tensor_model_parallel_size
    pb = PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    tokens = layout.local_seq_length * layout.micro_batch_size
    local = tokens // tp if layout.sequence_parallel else tokens
    h = config.hidden_size
    parts = _layer_parts(config, layout, selective=config.recompute_granularity == "selective")
    per_layer = sum(parts.values())
    stages = layout.stage_chunks(config, pipeline_stage)
    chunks, embedding, layers, output, loss_transient, recompute = [], 0, 0, 0, 0, "none"
    for stage in stages:
        n = len(stage.layers)
        groups, recompute = _recompute_groups(config, n)
        kept = [local * h * pb.residual if recomputed else m * per_layer for m, recomputed in groups]
        peak = max((sum(kept[:j]) + m * per_layer for j, (m, _) in enumerate(groups)), default=0)
        stored_layers = sum(m for m, recomputed in groups if not recomputed)
        chunk_embedding = _rope_bytes(config, layout, stored_layers, tables_held=stored_layers < n)
        if stage.pre_process:
            # Shard-local ids and the out-of-shard mask: whenever the TP group exists, i.e. in any run of more than
            # one rank (ParallelLayout.build makes a TP group of size 1 too); alone, a plain lookup.
            chunk_embedding += tokens * (8 + 1) if layout.world_size > 1 else 0
            if config.position_embedding_type == "learned_absolute" and layout.context_parallel_size == 1:
                chunk_embedding += layout.seq_length * 8  # the positions made in the forward (CP: the data's)
            if config.hidden_dropout > 0:
                chunk_embedding += local * h * (kernels.dropout_mask_bytes or pb.residual)
        chunk_output = chunk_loss = 0
        if stage.post_process:
            norm = _norm_bytes(config, kernels, local * h, pb.residual)
            vocab = config.padded_vocab_size(tp) // tp
            chunk_output = norm + tokens * h * pb.compute + tokens * vocab * 4 + tokens * (8 + 1)  # + targets, mask
            chunk_loss = tokens * vocab * (pb.compute + 4)
        attention_peak = 0
        if layout.context_parallel_size > 1 and n:
            # The last layer's attention: every earlier layer's tensors held, this layer's up to its attention.
            before = sum(kept) - (0 if groups[-1][1] else per_layer) + layer_bytes_until_attention(
                parts, recomputed=groups[-1][1])
            attention_peak = chunk_embedding + before + context_parallel_attention_transient(
                config, layout, pb.compute, selective=config.recompute_granularity == "selective")
        boundary = local * h * pb.residual  # the residual stream crossing between stages
        chunks.append(ChunkActivations(
            virtual_stage=stage.virtual_stage, first_layer=stage.layers.start, num_layers=n,
            per_microbatch=chunk_embedding + sum(kept) + chunk_output,
            sent_output=0 if stage.post_process else boundary, sent_grad=0 if stage.pre_process else boundary,
            loss_transient=chunk_loss, attention_peak=attention_peak,
            # The output layer's activations are gone by the time the first group is rebuilt.
            recompute_working_set=max(0, peak - sum(kept) - chunk_output)))
        embedding, layers, output, loss_transient = (embedding + chunk_embedding, layers + sum(kept),
                                                     output + chunk_output, loss_transient + chunk_loss)
    copies = 0
    if pb.compute < pb.weight:
        copies = sum(p.numel for p in _stage_parameter_shapes(config, tp, stages) if p.is_matmul_weight)
        copies *= pb.compute
    walk = schedule_memory(_training_order(layout, pipeline_stage), chunks)
    return ActivationBreakdown(embedding=embedding, per_layer=per_layer, layers=layers, output=output,
                               microbatches_in_flight=walk.in_flight,
                               recompute_working_set=max(c.recompute_working_set for c in chunks),
                               loss_transient=loss_transient, autocast_weight_copies=copies,
                               pipeline_buffers=walk.buffers_when_held, held_after_forward=walk.held + copies,
                               peak=walk.peak + copies, recompute=recompute, chunks=chunks, parts=parts)


def _training_order(layout: EstimateLayout, pipeline_stage: int) -> list:
    """The order of forwards and backwards the training step runs on this pipeline rank (one microbatch's
    forward and backward without pipelining: gradient accumulation runs microbatches one after the other)."""
    parallel = layout.parallel_config()
    if parallel.pipeline_model_parallel_size == 1:
        return [("F", 0, 0), ("B", 0, 0)]
    return schedule_order(parallel.schedule, layout.num_microbatches, parallel.pipeline_model_parallel_size,
                          pipeline_stage, parallel.virtual_pipeline_model_parallel_size)


def korthikanti_activation_bytes_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int,
                                           num_attention_heads: int, tensor_model_parallel_size: int = 1,
                                           sequence_parallel: bool = False, selective_recompute: bool = False) -> float:
    """Korthikanti et al. 2022, eqs. 1-5 (16-bit activations, 1-byte dropout masks, ffn = 4h, dense softmax):
    ``s b h (10 + 24/t + 5 a s/(h t))``, ``s b h (34 + 5 a s/h)/t`` with SP, the ``5 a s/h`` term dropped
    by selective recompute."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_model_parallel_size
    scores = 0.0 if selective_recompute else 5.0 * a * s / h
    if sequence_parallel:
        return s * b * h * (34.0 + scores) / t
    return s * b * h * (10.0 + 24.0 / t + scores / t)


@dataclass
class MemoryEstimate:
    """Memory of one rank of one pipeline stage (:func:`estimate_memory`: the most loaded), in bytes unless said
    otherwise."""

    params: int
    """Parameters of this rank's TP/PP shard of the model (before any DP sharding)."""
    model_params: int
    """Parameters of the whole model at TP=1 (:meth:`GPTConfig.num_parameters`)."""
    weights_bytes: int
    """Parameters as held (divided over DP under FSDP2)."""
    grads_bytes: int
    """Gradients."""
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
        out["stages"] = [{k: v for k, v in stage.to_dict().items() if k not in ("layout", "stages")}
                         for stage in self.stages]
        return out


def _stage_estimate(config: GPTConfig, layout: EstimateLayout, stage: int) -> MemoryEstimate:
    tp, dp = layout.tensor_model_parallel_size, layout.data_parallel_size
    pb = PRECISION_BYTES[layout.precision]
    chunks = layout.stage_chunks(config, stage)
    shapes = _stage_parameter_shapes(config, tp, chunks)
    num_layers = sum(len(chunk.layers) for chunk in chunks)
    params = sum(p.numel for p in shapes)
    moments = (2 if layout.optimizer == "adam" else int(layout.sgd_momentum > 0)) * pb.moment
    shard = -(-params // dp)  # flat buffers padded to a multiple of dp
    # ZeRO-1 keeps an fp32 master shard only beside half-precision weights (fp32 weights are their own main copy).
    main_bytes = DISTRIBUTED_MAIN_BYTES if pb.weight < 4 else 0
    replicated, distributed = params * (pb.master + moments), shard * (main_bytes + moments)
    unsharded = 0
    if layout.use_torch_fsdp2:  # every tensor split along dim 0 (rank 0 holds the rounded-up share)
        held = sum(-(-p.shape[0] // dp) * math.prod(p.shape[1:]) for p in shapes)
        weights, grads = held * pb.weight, held * pb.grad
        replicated = distributed = optimizer = held * (pb.master + moments)
        if dp > 1:
            layer = sum(p.numel for p in shapes if p.name.startswith("layers.")) // max(num_layers, 1)
            root = params - layer * num_layers
            unsharded = (root + 2 * layer) * pb.weight + layer * pb.grad
    elif layout.use_distributed_optimizer:
        weights, grads, optimizer = params * pb.weight, shard * dp * DISTRIBUTED_GRAD_BYTES, distributed
    else:
        weights, grads, optimizer = params * pb.weight, params * pb.grad, replicated
    host = 4 * len(shapes) if layout.optimizer == "adam" else 0
    acts = activation_breakdown(config, layout, stage)
    frozen = layout.frozen_models * params * pb.weight  # a plain copy of this rank's TP/PP shard, never DP-sharded
    total = weights + grads + optimizer + acts.peak + unsharded + frozen
    total += host if layout.device_type == "cpu" else 0
    return MemoryEstimate(params=params, model_params=config.num_parameters(), weights_bytes=weights,
                          grads_bytes=grads, optimizer_bytes=optimizer, optimizer_bytes_replicated=replicated,
                          optimizer_bytes_distributed=distributed, optimizer_host_bytes=host,
                          fsdp_unsharded_bytes=unsharded, frozen_bytes=frozen, activation_bytes=acts.peak,
                          total_bytes=total,
                          pipeline_stage=stage, activations=acts, layout=layout)


def estimate_stages(config: GPTConfig, layout: EstimateLayout) -> list:
    """The :class:`MemoryEstimate` of a rank of every pipeline stage, in stage order."""
    config.validate_parallelism(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                layout.context_parallel_size, layout.sequence_parallel)
    return [_stage_estimate(config, layout, s) for s in range(layout.pipeline_model_parallel_size)]


def estimate_memory(config: GPTConfig, layout: EstimateLayout) -> MemoryEstimate:
    """Per-rank memory of ``config`` trained with ``layout``: the pipeline stage with the largest total
    (the first such stage on a tie), with every stage's estimate in ``stages``."""
    stages = estimate_stages(config, layout)
    most = max(stages, key=lambda e: e.total_bytes)
    return dataclasses.replace(most, stages=stages)
