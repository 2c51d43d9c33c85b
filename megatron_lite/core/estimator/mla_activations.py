"""Activation bytes of a multi-latent attention layer (``core/models/mla.py``): what its attention side keeps for
backward on one rank for one microbatch, in place of the fused-QKV attention's (the norms and the MLP are the
layer's usual ones).

Per rank, ``T`` the (CP-local) tokens of a microbatch and ``L`` its sequence-parallel share (``T / TP`` under SP):

* the down-projections are replicated and run on the ``L`` local tokens: they keep the normalized input (each its
  own 16-bit copy under autocast; shared otherwise), and ``linear_q_proj`` (no ``q_lora_rank``) its gathered copy;
* each latent norm (``q_layernorm`` over ``q_lora_rank``, ``kv_layernorm`` over ``kv_lora_rank``) keeps its input
  and statistics like any norm -- the latent is a view of the down-projection's output, so the whole
  ``kv_lora_rank + qk_pos_emb_head_dim`` output stays alive -- except that an RMSNorm of a 16-bit input beside an
  fp32 weight (autocast) takes torch's composite path, which keeps an fp32 copy of the input and the fp32
  normalized tensor;
* the up-projections are column-parallel over the heads and keep their (gathered) inputs;
* RoPE'd parts: the rotation keeps only the (shared) cos/sin tables, or their 16-bit copies (counted with the
  tables, :func:`~megatron_lite.core.estimator.activations._rope_bytes`, over ``qk_pos_emb_head_dim``);
* the core attention gets q and k built by concatenation (new tensors of ``qk_head_dim + qk_pos_emb_head_dim`` per
  head) and v as a view of the key/value up-projection's output (which a kernel keeping v keeps whole). A fused
  kernel keeps q, k, v, its output and log-sum-exp as the fused-QKV attention's does; one that needs equal
  head widths (torch's CPU flash kernel) falls back to the math path when ``v_head_dim`` differs, which keeps the
  scaled q and k, the softmax and (computing in fp32) an fp32 copy of v. Selective recompute keeps q, k and v;
* the output projection keeps its input (``heads x v_head_dim`` per token).

Checked against the probe on CPU (``tests/unit/test_estimator.py``); the CUDA kernels' choices (cuDNN or the
memory-efficient kernel for unequal head widths) are assumed to keep what they keep for the fused-QKV attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.core.estimator.precision_bytes import KERNEL_SAVES, PRECISION_BYTES, norm_bytes
from megatron_lite.core.models.config import GPTConfig

if TYPE_CHECKING:  # memory.py imports activations.py, which imports this module: the type only
    from megatron_lite.core.estimator.memory import EstimateLayout


def mla_attention_parts(config: GPTConfig, layout: "EstimateLayout", selective: bool, residual: int = 0) -> dict:
    """Bytes the attention side of one MLA layer keeps for backward on one rank for one microbatch, by part
    (see the module docstring): replaces the fused-QKV attention's ``qkv_input``, ``qkv``, ``attention_out`` and
    ``logsumexp`` entries. ``residual``: bytes per element of the layer's residual stream (and so of its norm's
    output) where it is not the precision's."""
    assert config.kv_lora_rank and config.qk_head_dim and config.qk_pos_emb_head_dim and config.v_head_dim  # MLA
    tp, pb = layout.tensor_model_parallel_size, PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    s, b, h = layout.local_seq_length, layout.micro_batch_size, config.hidden_size
    tokens = s * b
    local = tokens // tp if layout.sequence_parallel else tokens
    c, r = pb.compute, residual or pb.residual
    heads, nope, pos, vd = (
        config.num_attention_heads // tp,
        config.qk_head_dim,
        config.qk_pos_emb_head_dim,
        config.v_head_dim,
    )
    qd, rkv, rq = nope + pos, config.kv_lora_rank, config.q_lora_rank
    sp = layout.sequence_parallel

    # The projections' inputs: under autocast every linear keeps its own 16-bit copy of the (fp32) norm output.
    copies = c != r
    inputs = local * h * c  # linear_kv_down_proj's
    if rq is not None:
        inputs += local * h * c if copies else 0  # linear_q_down_proj's (the same tensor without autocast)
    else:
        inputs += tokens * h * c if copies or sp else 0  # linear_q_proj's, gathered under SP
    parts = {"mla_inputs": inputs}

    latents = norm_bytes(config.normalization, kernels, local, rkv, c, pb.weight, local * (rkv + pos) * c)
    latents += tokens * rkv * c  # linear_kv_up_proj's input (gathered under SP)
    if rq is not None:
        latents += norm_bytes(config.normalization, kernels, local, rq, c, pb.weight, local * rq * c)
        latents += tokens * rq * c  # linear_q_up_proj's input
    parts["mla_latents"] = latents

    kv_up = tokens * heads * (nope + vd) * c  # v is a view of it
    q = k = tokens * heads * qd * c  # concatenated [positionless; rotated]
    equal_widths = qd == vd
    dropout = config.attention_dropout > 0 and kernels.attention_dropout_materializes_scores
    math_attention = not selective and (dropout or not (equal_widths or kernels.fused_attention_takes_unequal_widths))
    dense = 4 if kernels.dense_attention_in_fp32 else c
    out = tokens * heads * vd * c  # the output projection's input
    if selective:
        parts["qkv"] = q + k + kv_up
        parts["attention_out"] = out
    elif math_attention:
        # the scaled q and k the score matmul keeps; v as it is (a view) or upcast
        parts["qkv"] = 2 * tokens * heads * qd * dense + (tokens * heads * vd * dense if dense != c else kv_up)
        mask = kernels.dropout_mask_bytes or dense
        parts["attention_scores"] = b * heads * s * s * (dense + (dense + mask if dropout else 0))
        parts["attention_out"] = out
    else:
        copied = c == 4 and b > 1 and kernels.fp32_attention_output_is_copied
        parts["qkv"] = q + k + kv_up
        parts["attention_out"] = out * (2 if copied else 1)
        parts["logsumexp"] = b * heads * s * 4 + kernels.attention_rng_bytes
    return parts
