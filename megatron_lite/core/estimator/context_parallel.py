"""Activation bytes of context-parallel attention (``core/parallel/context_parallel.py``), per layer and rank.

Under context parallelism each rank holds ``s/C`` tokens of every sequence, split into two chunks of
``s/(2C)`` (the zigzag). The blockwise attention keeps, for backward, the queries and the local keys/values
(only the key/value heads: GQA is never expanded), its fp32 output and its fp32 log-sum-exp; the output
projection keeps its own input. While it runs (a transient of the forward) it also holds fp32 copies of
16-bit queries, the stacked local keys/values, the blocks in flight -- ``p2p``: the next block received while
the current one is computed (two blocks of ``s/C`` tokens with C = 2, three from C = 3 on, the rank's own
block staying referenced) or ``all_gather``: every rank's block, the whole sequence's keys and values --,
an fp32 copy of a 16-bit block it computes on, and what one block (one query chunk against one key chunk of
``s/(2C)`` tokens each) holds: through the fused kernels (the default, ``cp_fused_blocks``) its keys and values
copied out per query head and its own output and log-sum-exp; through the math path its scores (``s/(2C)`` x
``s/(2C)`` per head and sample). Checked against the probe on CP ranks, both paths
(``tests/unit/test_estimator.py``, ``test_context_parallel_activations_match_the_probe_on_cp_ranks``).
"""

from __future__ import annotations

from typing import Protocol

from megatron_lite.core.models.config import GPTConfig

# Score-sized tensors one math-path block computation holds at once (the scores, their scaled and masked copies;
# measured with the probe's forward peak on torch 2.13 CPU).
SCORE_TENSORS_IN_FLIGHT = 3


class ContextParallelLayout(Protocol):
    """What this module reads of a run's layout (``memory.EstimateLayout`` has it; memory.py imports this
    module, so the layout is described here rather than imported)."""

    micro_batch_size: int
    tensor_model_parallel_size: int
    context_parallel_size: int
    cp_comm_type: str
    cp_fused_blocks: bool

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence one rank holds."""


def _sizes(config: GPTConfig, layout: ContextParallelLayout) -> tuple[int, int, int, int]:
    """(local tokens of a microbatch, query heads per rank, key/value heads per rank, head width)."""
    tp = layout.tensor_model_parallel_size
    tokens = layout.local_seq_length * layout.micro_batch_size
    assert config.num_query_groups is not None and config.kv_channels is not None  # resolved by GPTConfig.__post_init__
    return tokens, config.num_attention_heads // tp, config.num_query_groups // tp, config.kv_channels


def context_parallel_attention_parts(
    config: GPTConfig, layout: ContextParallelLayout, compute_bytes: int, rope: bool, gqa: bool
) -> dict:
    """Bytes one layer keeps for backward around context-parallel attention, by tensor (matmul outputs of
    ``compute_bytes`` per element): replaces the ``qkv``, ``attention_out`` and ``logsumexp`` entries of the
    plain attention's accounting."""
    tokens, heads, groups, d = _sizes(config, layout)
    c = compute_bytes
    qkv_out = tokens * (heads + 2 * groups) * d * c
    # RoPE makes new q and k; cutting q out of GQA groups copies it; v is always a view of the fused output.
    q = tokens * heads * d * c if rope or gqa else 0
    k = tokens * groups * d * c if rope else 0
    return {
        "qkv": q + k + qkv_out,
        # The blockwise fp32 result, kept by the attention; laid out as [s, b, heads, d], so in fp32 the
        # output projection's input is a view of it, in 16 bits a copy of its own.
        "attention_fp32_out": tokens * heads * d * 4,
        "attention_out": 0 if c == 4 else tokens * heads * d * c,
        "logsumexp": tokens * heads * 4,
    }


def context_parallel_attention_transient(
    config: GPTConfig, layout: ContextParallelLayout, compute_bytes: int, selective: bool = False
) -> int:
    """Bytes context-parallel attention holds while it runs, beyond what the layer keeps for backward
    (under selective recompute its fp32 output and log-sum-exp are transient too)."""
    tokens, heads, groups, d = _sizes(config, layout)
    c = compute_bytes
    cp = layout.context_parallel_size
    block = 2 * tokens * groups * d * c  # one rank's stacked keys and values
    blocks = cp if layout.cp_comm_type == "all_gather" else min(cp - 1, 2)  # besides the rank's own
    # The blocks are computed in fp32: 16-bit queries and keys/values are copied, fp32 ones only viewed.
    fp32_queries = 0 if c == 4 else tokens * heads * d * 4
    fp32_block = 0 if c == 4 else 2 * tokens * groups * d * 4
    unkept = tokens * heads * (d + 1) * 4 if selective else 0
    return fp32_queries + block * (1 + blocks) + fp32_block + block_transient(config, layout) + unkept


def block_transient(config: GPTConfig, layout: ContextParallelLayout) -> int:
    """Bytes one block computation holds (one query chunk against one key chunk, ``s/(2C)`` tokens each, in
    fp32 whatever autocast says: the attention switches it off). A fused block hands the kernel its keys and
    values copied out per query head (contiguous, GQA expanded) and gets back its output and log-sum-exp; a
    math block holds score-sized tensors and the causal mask (one byte per score)."""
    _, heads, _, d = _sizes(config, layout)
    chunk, b = layout.local_seq_length // 2, layout.micro_batch_size
    if layout.cp_fused_blocks:
        return b * heads * chunk * (3 * d + 1) * 4
    return SCORE_TENSORS_IN_FLIGHT * b * heads * chunk * chunk * 4 + chunk * chunk


def layer_bytes_until_attention(parts: dict, recomputed: bool = False) -> int:
    """Bytes of one layer's kept tensors (``parts``) that exist when its context-parallel attention runs: the
    first norm's, the QKV projection's input and output (multi-latent attention: the down-projections' inputs and
    the latents instead of the QKV input), and what the attention allocates first (its fp32 output and
    log-sum-exp); the rest (projection input, second norm, MLP, dropout masks) comes after. In a recomputed layer
    (whose forward keeps nothing) the norm's own tensors are already freed by then."""
    norm = 0 if recomputed else parts["norms"] // 2
    inputs = parts.get("qkv_input", 0) + parts.get("mla_inputs", 0) + parts.get("mla_latents", 0)
    return norm + inputs + parts["qkv"] + parts.get("attention_fp32_out", 0) + parts.get("logsumexp", 0)
