"""Activation bytes one rank keeps for backward, after Korthikanti et al. 2022.

Add up, layer by layer, every tensor autograd keeps for the backward. Their ``s b h (34 + 5 a s/h)`` assumes GPT-3
blocks in 16-bit (:func:`korthikanti_activation_bytes_per_layer`); :func:`activation_breakdown` applies the same
accounting to what this model really keeps (RMSNorm/LayerNorm, SwiGLU/GeLU, GQA, RoPE, ``v`` as a view of the
fused QKV output, flash attention without ``s x s`` scores, the fp32 residual stream and bf16 weight copies of
autocast, the fp32 softmax of the loss, recompute), checked against :mod:`megatron_lite.core.estimator.probe` on CPU
and on an H200. Under pipeline parallelism the schedule decides how many chunk-microbatches are alive at once
(:func:`~megatron_lite.core.estimator.schedule_memory.schedule_memory`); under context parallelism every per-token
tensor holds ``seq_length / C`` tokens and the attention is the blockwise kind
(:mod:`megatron_lite.core.estimator.context_parallel`). An MoE layer keeps its router's, dispatcher's and experts'
tensors in place of the dense MLP's (:mod:`megatron_lite.core.estimator.moe_activations`, balanced routing assumed);
a multi-latent attention layer its projections', latent norms' and attention's in place of the fused QKV's
(:mod:`megatron_lite.core.estimator.mla_activations`), and the last stage also the MTP depths'
(:mod:`megatron_lite.core.estimator.mtp_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_lite.core.estimator.context_parallel import (
    context_parallel_attention_parts,
    context_parallel_attention_transient,
    layer_bytes_until_attention,
)
from megatron_lite.core.estimator.mla_activations import mla_attention_parts
from megatron_lite.core.estimator.moe_activations import moe_dispatch_transient, moe_layer_parts
from megatron_lite.core.estimator.mtp_activations import mtp_depth_bytes
from megatron_lite.core.estimator.precision_bytes import KERNEL_SAVES, PRECISION_BYTES, norm_bytes
from megatron_lite.core.estimator.schedule_memory import ChunkActivations, schedule_memory
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern
from megatron_lite.core.models.mtp_config import mtp_depth
from megatron_lite.core.models.recompute import full_recompute_groups
from megatron_lite.core.parallel.pipeline.schedules import schedule_order, splits_backward

if TYPE_CHECKING:  # memory.py imports this module: the type only
    from megatron_lite.core.estimator.memory import EstimateLayout

# What 'selective' recompute may rerun in the backward (GPTConfig.recompute_modules), in words.
SELECTIVE_MODULES = {"core_attn": "core attention", "moe": "MoE layers"}


@dataclass
class ActivationBreakdown:
    """Bytes one rank keeps for backward, by part (one microbatch unless said otherwise)."""

    embedding: int = 0
    """Shard-local token ids (TP), position ids, embedding dropout mask, rotary tables (not the batch)."""
    per_layer: int = 0
    """One dense transformer layer (selective recompute applied; full recompute rebuilds this per layer)."""
    per_moe_layer: int = 0
    """One MoE transformer layer, balanced routing assumed (0 without MoE layers)."""
    moe_dispatch_transient: int = 0
    """Extra bytes while an MoE layer's dispatcher moves its tokens (gathered or permuted tokens; 0 without MoE)."""
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
    """Per-layer bytes by tensor (for reports and tests): a dense layer's."""
    moe_parts: dict = field(default_factory=dict)
    """An MoE layer's bytes by tensor (empty without MoE layers)."""

    @property
    def total(self) -> int:
        """Held after the forward plus the chunk rebuilt by recompute (the backward's peak)."""
        return self.held_after_forward + self.recompute_working_set


def _layer_parts(
    config: GPTConfig, layout: EstimateLayout, selective: bool = False, moe: bool = False, residual: int = 0
) -> dict:
    """Bytes one layer (an MoE layer where ``moe``) saves, by tensor, for one microbatch on one rank (see the
    module docstring); ``residual``: bytes per element of its residual stream where it is not the precision's
    (an MTP depth's layer runs on its 16-bit projection's output under autocast)."""
    tp, pb = layout.tensor_model_parallel_size, PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    h = config.hidden_size
    assert config.num_query_groups is not None and config.ffn_hidden_size is not None  # resolved by GPTConfig
    tokens = layout.local_seq_length * layout.micro_batch_size  # inside TP regions every rank sees them all ...
    local = tokens // tp if layout.sequence_parallel else tokens  # ... the residual stream may be split
    c, r = pb.compute, residual or pb.residual
    ffn = config.ffn_hidden_size // tp
    gqa, rope = config.num_attention_heads != config.num_query_groups, config.position_embedding_type == "rope"

    parts = {"norms": 2 * norm_bytes(config.normalization, kernels, local, h, r, pb.weight)}
    if config.multi_latent_attention:
        parts.update(mla_attention_parts(config, layout, selective, r))
    else:
        parts.update(_attention_parts(config, layout, selective))
    if layout.context_parallel_size > 1 and not selective:
        parts.update(context_parallel_attention_parts(config, layout, c, rope=rope, gqa=gqa))
    if moe and config.recomputes("moe"):
        parts["moe_input"] = local * h * r  # the checkpointed layer's input; the rest is rebuilt in backward
    elif moe:
        parts.update(moe_layer_parts(config, layout, r))
    else:
        parts["fc1_input"] = tokens * h * c  # all-gathered under SP
        gated = config.activation == "swiglu"
        parts["mlp"] = tokens * ffn * c * (4 if gated else 2)  # fc1 output, [silu output, product | gelu output]
    if config.hidden_dropout > 0:
        branch = r if config.add_bias_linear else c  # an fp32 bias promotes the branch to fp32
        parts["dropout_masks"] = 2 * local * h * (kernels.dropout_mask_bytes or branch)
    return parts


def _attention_parts(config: GPTConfig, layout: EstimateLayout, selective: bool) -> dict:
    """Bytes the fused-QKV attention of one layer keeps for backward, by tensor (see :func:`_layer_parts`)."""
    tp, pb = layout.tensor_model_parallel_size, PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    s, b, h, d = layout.local_seq_length, layout.micro_batch_size, config.hidden_size, config.kv_channels
    assert d is not None and config.num_query_groups is not None  # resolved by GPTConfig.__post_init__
    tokens, c = s * b, pb.compute
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    gqa, rope = heads != groups, config.position_embedding_type == "rope"
    math_attention = config.attention_dropout > 0 and kernels.attention_dropout_materializes_scores
    parts = {"qkv_input": tokens * h * c}  # all-gathered under SP
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
            parts["attention_scores"] = b * heads * s * s * (2 * dense + (kernels.dropout_mask_bytes or dense))
    else:
        copied = c == 4 and b > 1 and kernels.fp32_attention_output_is_copied
        parts["attention_out"] = attn_out * (2 if copied else 1)  # output = (or copied into) the projection's input
        parts["logsumexp"] = b * heads * s * 4 + kernels.attention_rng_bytes
    return parts


def _rope_bytes(config: GPTConfig, layout: EstimateLayout, stored_layers: int, tables_held: bool) -> int:
    """cos/sin tables: fp32 attention shares them; 16-bit attention casts a copy per rotation of q and k
    in every layer that stores its activations; checkpointed layers hold the fp32 tables as inputs."""
    if config.position_embedding_type != "rope":
        return 0
    assert config.kv_channels is not None  # resolved by GPTConfig.__post_init__
    # MLA rotates only the decoupled positional part of each head
    rotated = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.kv_channels
    assert rotated is not None  # checked by GPTConfig.__post_init__
    rot = int(rotated * config.rotary_percent)
    rot -= rot % 2
    # Under CP the positions come per sample ([b, s/C], the zigzag share's), and so do the tables.
    rows = layout.local_seq_length * (layout.micro_batch_size if layout.context_parallel_size > 1 else 1)
    tables = 2 * rows * rot * 4
    c = PRECISION_BYTES[layout.precision].compute
    if c == 4:
        return tables if stored_layers or tables_held else 0
    return stored_layers * 4 * rows * rot * c + (tables if tables_held else 0)


def _recompute_groups(config: GPTConfig, stage_layers: int) -> tuple:
    """([(layer positions in the stage, recomputed?)] in forward order, description), grouped as ``GPTModel``
    groups its layers for 'full' recompute; 'selective' checkpoints the core attention and/or the MoE layers
    (``recompute_modules``; see :func:`_layer_parts`)."""
    groups = full_recompute_groups(config, stage_layers)
    k = config.recompute_num_layers
    if config.recompute_granularity != "full":
        modules = [name for module, name in SELECTIVE_MODULES.items() if config.recomputes(module)]
        return groups, f"selective ({', '.join(modules)})" if config.recompute_granularity else "none"
    assert k is not None  # GPTConfig refuses 'full' granularity without recompute_num_layers
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
    selective = config.recomputes("core_attn")
    parts = _layer_parts(config, layout, selective)
    per_layer = sum(parts.values())
    is_moe = moe_layer_pattern(config)
    moe_parts = _layer_parts(config, layout, selective, moe=True) if any(is_moe) else {}
    per_moe_layer = sum(moe_parts.values())
    dispatch = moe_dispatch_transient(config, layout) if any(is_moe) else 0
    # 'moe' recompute rebuilds one MoE layer at a time in the backward, beside its kept input
    moe_rebuilt = sum(moe_layer_parts(config, layout).values()) if config.recomputes("moe") else 0
    stages = layout.stage_chunks(config, pipeline_stage)
    chunks, embedding, layers, output, loss_transient, recompute = [], 0, 0, 0, 0, "none"
    for stage in stages:
        n = len(stage.layers)
        groups, recompute = _recompute_groups(config, n)
        sizes = [per_moe_layer if is_moe[i] else per_layer for i in stage.layers]  # per position in the stage
        has_moe = any(is_moe[i] for i in stage.layers)
        full = [sum(sizes[p] for p in positions) for positions, _ in groups]
        kept = [local * h * pb.residual if recomputed else size for (_, recomputed), size in zip(groups, full)]
        peak = max((sum(kept[:j]) + size for j, size in enumerate(full)), default=0)
        stored_layers = sum(len(positions) for positions, recomputed in groups if not recomputed)
        # The MTP depths' layers rotate too (on the last stage), checkpointed under 'full' recompute.
        mtp_layers = mtp_depth(config) if stage.post_process else 0
        mtp_stored = 0 if config.recompute_granularity == "full" else mtp_layers
        chunk_embedding = _rope_bytes(
            config, layout, stored_layers + mtp_stored, tables_held=stored_layers + mtp_stored < n + mtp_layers
        )
        if stage.pre_process:
            # Shard-local ids and the out-of-shard mask: whenever the TP group exists, i.e. in any run of more than
            # one rank (ParallelLayout.build makes a TP group of size 1 too); alone, a plain lookup.
            chunk_embedding += tokens * (8 + 1) if layout.world_size > 1 else 0
            if config.position_embedding_type == "learned_absolute" and layout.context_parallel_size == 1:
                chunk_embedding += layout.seq_length * 8  # the positions made in the forward (CP: the data's)
            if config.hidden_dropout > 0:
                chunk_embedding += local * h * (kernels.dropout_mask_bytes or pb.residual)
        chunk_output = chunk_loss = mtp_rebuilt = 0
        if stage.post_process:
            norm = norm_bytes(config.normalization, kernels, local, h, pb.residual, pb.weight)
            vocab = config.padded_vocab_size(tp) // tp
            logits = tokens * h * pb.compute + tokens * vocab * 4 + tokens * (8 + 1)  # input, softmax, targets, mask
            # the MTP depths' layers: the model's last layer's kind, on their projection's (compute-dtype) output
            mtp_layer = _layer_parts(config, layout, selective, moe=is_moe[-1], residual=pb.compute)
            mtp, mtp_rebuilt = mtp_depth_bytes(config, layout, sum(mtp_layer.values()), logits)
            chunk_output = norm + logits + mtp
            chunk_loss = tokens * vocab * (pb.compute + 4)
            # GPTModel.forward keeps the main logits referenced while the MTP depths compute their losses
            chunk_loss += tokens * vocab * pb.compute if mtp_layers else 0
        attention_peak = 0
        if layout.context_parallel_size > 1 and n:
            # The last layer's attention: every earlier layer's tensors held, this layer's up to its attention.
            before = (
                sum(kept)
                - (0 if groups[-1][1] else sizes[-1])
                + layer_bytes_until_attention(parts, recomputed=groups[-1][1])
            )
            attention_peak = (
                chunk_embedding
                + before
                + context_parallel_attention_transient(config, layout, pb.compute, selective=selective)
            )
        boundary = local * h * pb.residual  # the residual stream crossing between stages
        chunks.append(
            ChunkActivations(
                virtual_stage=stage.virtual_stage,
                first_layer=stage.layers.start,
                num_layers=n,
                per_microbatch=chunk_embedding + sum(kept) + chunk_output,
                sent_output=0 if stage.post_process else boundary,
                sent_grad=0 if stage.pre_process else boundary,
                loss_transient=chunk_loss,
                attention_peak=attention_peak,
                # Upper bound: the chunk's kept tensors all alive while its last MoE layer dispatches.
                dispatch_peak=chunk_embedding + sum(kept) + dispatch if has_moe else 0,
                # The output layer's activations are gone by the time the first group (or MoE layer) is rebuilt.
                recompute_working_set=max(
                    0,
                    peak - sum(kept) - chunk_output,
                    moe_rebuilt - chunk_output if has_moe else 0,
                    mtp_rebuilt - logits if mtp_rebuilt else 0,  # the last depth's, its logits' bytes freed
                ),
            )
        )
        embedding, layers, output, loss_transient = (
            embedding + chunk_embedding,
            layers + sum(kept),
            output + chunk_output,
            loss_transient + chunk_loss,
        )
    copies = 0
    if pb.compute < pb.weight:
        copies = sum(p.numel for p in layout.stage_parameter_shapes(config, stages) if p.is_matmul_weight)
        copies *= pb.compute
    walk = schedule_memory(_training_order(layout, pipeline_stage), chunks)
    return ActivationBreakdown(
        embedding=embedding,
        per_layer=per_layer,
        per_moe_layer=per_moe_layer,
        moe_dispatch_transient=dispatch,
        layers=layers,
        output=output,
        microbatches_in_flight=walk.in_flight,
        recompute_working_set=max(c.recompute_working_set for c in chunks),
        loss_transient=loss_transient,
        autocast_weight_copies=copies,
        pipeline_buffers=walk.buffers_when_held,
        held_after_forward=walk.held + copies,
        peak=walk.peak + copies,
        recompute=recompute,
        chunks=chunks,
        parts=parts,
        moe_parts=moe_parts,
    )


def _training_order(layout: EstimateLayout, pipeline_stage: int) -> list:
    """The order of forwards and backwards the training step runs on this pipeline rank (one microbatch's
    forward and backward without pipelining: gradient accumulation runs microbatches one after the other)."""
    parallel = layout.parallel_config()
    if parallel.pipeline_model_parallel_size == 1:
        return [("F", 0, 0), ("B", 0, 0)]
    order = schedule_order(
        parallel.schedule,
        layout.num_microbatches,
        parallel.pipeline_model_parallel_size,
        pipeline_stage,
        parallel.virtual_pipeline_model_parallel_size,
    )
    if splits_backward(order):
        # A zero-bubble schedule's microbatch is counted alive until its weight pass, as if its whole backward ran
        # there: an upper bound (the input-gradient pass already frees all but the linear layers' inputs and output
        # gradients, which the weight pass needs).
        order = [(kind if kind == "F" else "B", chunk, mb) for kind, chunk, mb in order if kind != "B"]
    return order


def korthikanti_activation_bytes_per_layer(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_attention_heads: int,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
) -> float:
    """Korthikanti et al. 2022, eqs. 1-5 (16-bit activations, 1-byte dropout masks, ffn = 4h, dense softmax):
    ``s b h (10 + 24/t + 5 a s/(h t))``, ``s b h (34 + 5 a s/h)/t`` with SP, the ``5 a s/h`` term dropped
    by selective recompute."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_model_parallel_size
    scores = 0.0 if selective_recompute else 5.0 * a * s / h
    if sequence_parallel:
        return s * b * h * (34.0 + scores) / t
    return s * b * h * (10.0 + 24.0 / t + scores / t)
