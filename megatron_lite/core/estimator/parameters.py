"""The parameter tensors one rank holds, as ``GPTModel`` builds them: TP shards, the padded vocabulary, replicated
norms and row-parallel biases, the layers of its pipeline stages (what weights, gradients and optimizer state are
counted from)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.layout import ParallelConfig


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


def parameter_shapes(
    config: GPTConfig,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    pipeline_stage: int = 0,
    *,
    virtual_pipeline_model_parallel_size: int = 1,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
) -> list:
    """The :class:`ParamShape` of every parameter one rank of pipeline rank ``pipeline_stage`` holds, in the
    order of ``GPTModel.named_parameters()``.

    The layers are cut as ``GPTModel`` cuts them (:meth:`ParallelConfig.stage_chunks`: uneven first/last
    stages, ``V`` virtual stages per rank). The first stage holds the embedding, the last the final norm
    and the output layer; with tied embeddings the last stage keeps its own copy of the word embedding
    (Megatron's), which the output layer multiplies by.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    config.validate_parallelism(tp, pp)
    cut = ParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
    )
    return stage_parameter_shapes(config, tp, cut.stage_chunks(config.num_layers, pipeline_stage))


def stage_parameter_shapes(config: GPTConfig, tp: int, chunks: list) -> list:
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    assert (
        f is not None
        and d is not None
        and config.num_query_groups is not None
        and config.max_position_embeddings is not None
    )  # resolved by GPTConfig.__post_init__
    vocab = config.padded_vocab_size(tp)
    qkv = d * (config.num_attention_heads + 2 * config.num_query_groups)
    fc1 = f * (2 if config.activation == "swiglu" else 1)
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
        linear(f"{p}.self_attention.linear_qkv", qkv // tp, h, (qkv // tp,) if bias or config.add_qkv_bias else None)
        linear(f"{p}.self_attention.linear_proj", h, config.num_attention_heads * d // tp, (h,) if bias else None)
        if config.qk_layernorm:  # one head's width, shared by every head: replicated
            norm(f"{p}.self_attention.q_layernorm", d)
            norm(f"{p}.self_attention.k_layernorm", d)
        norm(f"{p}.pre_mlp_layernorm")
        linear(f"{p}.mlp.linear_fc1", fc1 // tp, h, (fc1 // tp,) if bias else None)
        linear(f"{p}.mlp.linear_fc2", h, f // tp, (h,) if bias else None)
    if last:
        norm("final_layernorm")
        if not tied:
            out.append(ParamShape("output_layer.weight", (vocab // tp, h), True))
    return out
