"""The parameter tensors one rank holds, as ``GPTModel`` builds them: TP shards, the padded vocabulary, replicated
norms and row-parallel biases, the layers of its pipeline stages, and in MoE layers the replicated router, this
rank's ``E / EP`` experts split over ETP and the TP-split shared expert (what weights, gradients and optimizer state
are counted from). With a LoRA configuration, the adapters ``apply_lora`` adds (sharded like their layer) follow
each adapted layer's own tensors, and every other tensor is frozen."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern
from megatron_lite.core.models.mtp_config import mtp_depth
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.pipeline_stages import PipelineLayout
from megatron_lite.core.peft.config import LoRAConfig
from megatron_lite.core.peft.lora import is_adapter_parameter


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor as a rank holds it."""

    name: str
    """Name in ``GPTModel.named_parameters()``."""
    shape: tuple
    """Local (per-rank) shape."""
    is_matmul_weight: bool
    """Multiplied as a matrix under autocast, which keeps one low-precision copy of it during the step (not the
    router, which multiplies in fp32, nor the experts, cast per expert and forward: see the activations)."""
    is_expert: bool = False
    """A weight of the routed experts: replicated over expert-DP (not DP x CP), where ZeRO-1 shards its state."""
    trainable: bool = True
    """False for a frozen tensor (the base of a LoRA fine-tune): no gradient, no optimizer state."""

    @property
    def numel(self) -> int:
        """Elements of the local tensor."""
        return math.prod(self.shape)


def parameter_shapes(
    config: GPTConfig,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    pipeline_stage: int = 0,
    *,
    virtual_pipeline_model_parallel_size: int = 1,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    pipeline_model_parallel_layout: Optional[PipelineLayout] = None,
    pipeline_schedule: Optional[str] = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    lora: Optional[LoRAConfig] = None,
) -> list:
    """The :class:`ParamShape` of every parameter one rank of pipeline rank ``pipeline_stage`` holds, in the
    order of ``GPTModel.named_parameters()``.

    The layers are cut as ``GPTModel`` cuts them (:meth:`ParallelConfig.stage_chunks`: uneven first/last
    stages or a ``pipeline_model_parallel_layout``, ``V`` virtual stages per rank, placed in a V under
    ``pipeline_schedule`` 'zbv'/'dualpipev'). The first stage holds the embedding, the last the final norm and the
    output layer; with tied embeddings the last stage keeps its own copy of the word embedding (Megatron's), which the
    output layer multiplies by, unless one rank holds both (the V placement). MoE layers hold
    ``num_moe_experts / EP`` experts, each split over ``expert_tensor_parallel_size`` ranks (None: TP's).
    ``lora``: the adapters a LoRA fine-tune adds, the rest frozen.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    config.validate_parallelism(tp, pp)
    cut = ParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        pipeline_model_parallel_layout=pipeline_model_parallel_layout,
        pipeline_schedule=pipeline_schedule,
    )
    return stage_parameter_shapes(
        config,
        tp,
        cut.stage_chunks(config.num_layers, pipeline_stage),
        etp=expert_tensor_parallel_size,
        ep=expert_model_parallel_size,
        lora=lora,
    )


def stage_parameter_shapes(
    config: GPTConfig,
    tp: int,
    chunks: list,
    etp: Optional[int] = None,
    ep: int = 1,
    lora: Optional[LoRAConfig] = None,
) -> list:
    """The parameters of the layers of ``chunks`` (and the embedding/output they carry) on one rank of TP ``tp``,
    expert-parallel ``ep`` and expert tensor-parallel ``etp`` (None: ``tp``); with ``lora``, the adapters of the
    layers it selects (trainable) and everything else frozen."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    assert (
        f is not None
        and d is not None
        and config.num_query_groups is not None
        and config.max_position_embeddings is not None
    )  # resolved by GPTConfig.__post_init__
    vocab = config.padded_vocab_size(tp)
    qkv = d * (config.num_attention_heads + 2 * config.num_query_groups)
    first = any(chunk.pre_process for chunk in chunks)
    last = any(chunk.post_process for chunk in chunks)
    tied = config.share_embeddings_and_output_weights
    out: list = []

    def norm(prefix: str, width: int = h) -> None:
        out.append(ParamShape(f"{prefix}.weight", (width,), False))
        if config.normalization == "LayerNorm":
            out.append(ParamShape(f"{prefix}.bias", (width,), False))

    def linear(prefix: str, rows: int, cols: int, bias: Optional[tuple]) -> None:
        out.append(ParamShape(f"{prefix}.weight", (rows, cols), True))
        if bias is not None:
            out.append(ParamShape(f"{prefix}.bias", bias, False))
        if lora is not None and lora.selects(prefix):
            # A [dim, in] and B [out, dim] of the local shard [rows, cols]: on a column layer A is whole and B split
            # like the weight's rows; on a row layer A is split like the weight's columns and B whole; on a
            # replicated one (MLA's down-projections) both whole.
            out.append(ParamShape(f"{prefix}.adapter.linear_in.weight", (lora.dim, cols), True))
            out.append(ParamShape(f"{prefix}.adapter.linear_out.weight", (rows, lora.dim), True))

    def mlp(prefix: str, width: int) -> None:
        # Column-parallel fc1 (SwiGLU: [gate; up]), row-parallel fc2 with a replicated bias.
        fc1 = width * (2 if config.activation == "swiglu" else 1)
        linear(f"{prefix}.linear_fc1", fc1 // tp, h, (fc1 // tp,) if bias else None)
        linear(f"{prefix}.linear_fc2", h, width // tp, (h,) if bias else None)

    def moe(prefix: str) -> None:
        assert config.num_moe_experts is not None and config.moe_ffn_hidden_size is not None  # an MoE model
        width, split, local = config.moe_ffn_hidden_size, tp if etp is None else etp, config.num_moe_experts // ep
        fc1 = width * (2 if config.activation == "swiglu" else 1)
        out.append(ParamShape(f"{prefix}.router.weight", (config.num_moe_experts, h), False))
        for name, shape, bias_shape in (
            ("linear_fc1", (local, fc1 // split, h), (local, fc1 // split)),
            ("linear_fc2", (local, h, width // split), (local, h)),
        ):
            out.append(ParamShape(f"{prefix}.experts.{name}.weight", shape, False, is_expert=True))
            if bias:
                out.append(ParamShape(f"{prefix}.experts.{name}.bias", bias_shape, False, is_expert=True))
            if lora is not None and lora.selects(f"{prefix}.experts.{name}"):
                # per expert, as on a dense layer: A [E, dim, in] whole over ETP on fc1, split like fc2's columns; B
                # [E, out, dim] split like fc1's rows, whole on fc2
                experts, rows, cols = shape
                adapter = f"{prefix}.experts.{name}.adapter"
                out.append(ParamShape(f"{adapter}.linear_in.weight", (experts, lora.dim, cols), True, is_expert=True))
                out.append(ParamShape(f"{adapter}.linear_out.weight", (experts, rows, lora.dim), True, is_expert=True))
        if config.moe_shared_expert_intermediate_size is not None:
            if config.moe_shared_expert_gate:  # the module's own parameter comes before its submodules'
                out.append(ParamShape(f"{prefix}.shared_experts.gate_weight", (1, h), True))
            mlp(f"{prefix}.shared_experts", config.moe_shared_expert_intermediate_size)

    def mla(prefix: str) -> None:
        # Multi-latent attention: the down-projections and latent norms replicated, the up-projections
        # column-parallel (heads split), the output projection row-parallel; no biases (refused with MLA).
        assert config.kv_lora_rank and config.qk_head_dim and config.qk_pos_emb_head_dim and config.v_head_dim
        heads = config.num_attention_heads // tp
        q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
        if config.q_lora_rank is None:
            linear(f"{prefix}.linear_q_proj", heads * q_head, h, None)
        else:
            linear(f"{prefix}.linear_q_down_proj", config.q_lora_rank, h, None)  # replicated: whole on every rank
            norm(f"{prefix}.q_layernorm", config.q_lora_rank)
            linear(f"{prefix}.linear_q_up_proj", heads * q_head, config.q_lora_rank, None)
        latent = config.kv_lora_rank
        linear(f"{prefix}.linear_kv_down_proj", latent + config.qk_pos_emb_head_dim, h, None)
        norm(f"{prefix}.kv_layernorm", latent)
        linear(f"{prefix}.linear_kv_up_proj", heads * (config.qk_head_dim + config.v_head_dim), latent, None)
        linear(f"{prefix}.linear_proj", h, heads * config.v_head_dim, None)

    bias = config.add_bias_linear
    depth = mtp_depth(config)
    if first or (last and (tied or depth)):
        # A lookup on the first stage (and for the MTP block); on the last stage of tied embeddings the output
        # layer's matrix.
        out.append(ParamShape("embedding.weight", (vocab // tp, h), last and tied))
    if first and config.position_embedding_type == "learned_absolute":
        out.append(ParamShape("position_embeddings.weight", (config.max_position_embeddings, h), False))
    is_moe = moe_layer_pattern(config)

    def transformer_layer(p: str, moe_mlp: bool) -> None:
        norm(f"{p}.input_layernorm")
        if config.multi_latent_attention:
            mla(f"{p}.self_attention")
        else:
            # Column-parallel: output rows (and bias) split; row-parallel: input columns split, bias replicated.
            linear(
                f"{p}.self_attention.linear_qkv", qkv // tp, h, (qkv // tp,) if bias or config.add_qkv_bias else None
            )
            linear(f"{p}.self_attention.linear_proj", h, config.num_attention_heads * d // tp, (h,) if bias else None)
        if config.qk_layernorm:  # one head's width, shared by every head: replicated
            norm(f"{p}.self_attention.q_layernorm", d)
            norm(f"{p}.self_attention.k_layernorm", d)
        norm(f"{p}.pre_mlp_layernorm")
        if moe_mlp:
            moe(f"{p}.mlp")
        else:
            mlp(f"{p}.mlp", f)

    for i in (i for chunk in chunks for i in chunk.layers):
        transformer_layer(f"layers.{i}", is_moe[i])
    if last:
        norm("final_layernorm")
        if not tied:
            out.append(ParamShape("output_layer.weight", (vocab // tp, h), True))
        for i in range(config.num_layers, config.num_layers + depth):
            # an MTP depth: its input norms, the column-parallel projection of [embedding; hidden], a layer of the
            # last decoder layer's kind, its own final norm
            p = f"mtp.layers.{i}"
            norm(f"{p}.enorm")
            norm(f"{p}.hnorm")
            linear(f"{p}.eh_proj", h // tp, 2 * h, None)
            transformer_layer(f"{p}.transformer_layer", is_moe[-1])
            norm(f"{p}.final_layernorm")
    if lora is not None:
        out = [dataclasses.replace(p, trainable=is_adapter_parameter(p.name)) for p in out]
    return out
