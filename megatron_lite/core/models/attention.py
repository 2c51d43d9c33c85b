"""Self-attention with a fused, tensor-parallel QKV projection and grouped-query attention."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.norms import Norm
from megatron_lite.core.models.recompute import checkpoint, recompute_active
from megatron_lite.core.models.rope import apply_rotary
from megatron_lite.core.parallel.context_parallel import AttentionContext, context_parallel_attention, packed_attention
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class SelfAttention(nn.Module):
    """Causal self-attention over ``[s, b, h]`` activations.

    The QKV weight uses Megatron's layout ``[groups, (heads_per_group + 2), head_dim]`` along its
    output dimension, so a contiguous TP split hands each rank whole query groups with their keys
    and values. With ``qk_layernorm`` each query and key head is normalized over its width before
    RoPE (Qwen3's ``q_norm``/``k_norm``, Megatron's ``q_layernorm``/``k_layernorm``): one weight of a
    head's width, shared by every head, so replicated over TP with a gradient summed over TP.
    """

    def __init__(self, config: GPTConfig, layout: ParallelLayout, output_init_std: float):
        super().__init__()
        tp = layout.tp_size
        # resolved by GPTConfig.__post_init__
        assert config.kv_channels is not None and config.num_query_groups is not None
        self.head_dim = config.kv_channels
        self.groups_per_rank = config.num_query_groups // tp
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        self.core_attention = CoreAttention(config.attention_dropout, self.q_per_group)
        # 'selective' recompute: the s x s attention scores/probabilities are the largest activations
        # and the cheapest to rebuild (Korthikanti et al. 2022), so only this part is checkpointed.
        self.recompute_core_attention = config.recomputes("core_attn")
        qkv_size = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            layout,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_std=config.init_method_std,
        )
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.kv_channels,
            config.hidden_size,
            layout,
            bias=config.add_bias_linear,
            init_std=output_init_std,
        )
        self.q_layernorm: Optional[Norm] = None
        self.k_layernorm: Optional[Norm] = None
        if config.qk_layernorm:
            # Under SP the attention's input is already gathered: these norms see every token of this
            # rank's heads, so their gradients are partial over TP through the heads, not the sequence.
            norm = (config.normalization, self.head_dim, config.layernorm_epsilon)
            self.q_layernorm = Norm(*norm, sequence_parallel=False, shared_by_tp_heads=True)
            self.k_layernorm = Norm(*norm, sequence_parallel=False, shared_by_tp_heads=True)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[..., heads, head_dim]``, each head normalized over its channels with ``qk_layernorm``
        (unchanged without it)."""
        if self.q_layernorm is None or self.k_layernorm is None:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        rng: RNGStatesTracker,
        context: Optional[AttentionContext] = None,
    ) -> torch.Tensor:
        """``context`` describes packed rows and context parallelism (None: plain causal rows)."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_per_rank, self.q_per_group + 2, self.head_dim)
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.groups_per_rank * self.q_per_group, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        q, k = self.normalize_qk(q, k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k, v = self.cached_kv(k, v)
        return self.linear_proj(self.core_attention.run(q, k, v, rng, context, self.recompute_core_attention))

    def cached_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (after RoPE) and values as a KV cache holds them; the identity here. Training and
        generation both pass through it, so KV-cache quantization (``megatron_lite.post_training.kv_quant``)
        wraps this one method and trains, calibrates and generates with the same quantized K and V."""
        return k, v

    # --- generation: beside the training path -----------------------------------------------
    def inference_forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        kv: Optional[tuple[torch.Tensor, torch.Tensor]],
        step,
    ) -> torch.Tensor:
        """Attention of this step's tokens ``x`` [s, b, h] (a prefill or one decode token per row).

        ``step`` is a :class:`~megatron_lite.core.inference.kv_cache.InferenceStep`; ``rope`` is (cos, sin)
        [s, b, 1, 1, dim] (broadcast over groups and heads). With a cache (``kv``: this layer's key and value
        buffers [b, groups, max_len, d]) the new keys and values are written at slots ``step.start ..`` and
        the queries attend to every cached slot up to theirs; without one they attend to this step's tokens
        only (recompute)."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        per_group = self.q_per_group
        qkv = qkv.view(s, b, self.groups_per_rank, per_group + 2, self.head_dim)
        # Views and few ops: this runs per layer per token, and a decode step's tensors are tiny.
        qk = qkv.narrow(3, 0, per_group + 1)
        if self.q_layernorm is not None:
            qk = torch.cat(self.normalize_qk(qk.narrow(3, 0, per_group), qk.narrow(3, per_group, 1)), dim=3)
        if rope is not None:  # queries and keys rotated in one go: half the small ops of a decode step
            qk = rotate(qk, *rope)
        q = qk.narrow(3, 0, per_group)
        k = qk.select(3, per_group).permute(1, 2, 0, 3)  # [b, groups, s, d]
        v = qkv.select(3, per_group + 1).permute(1, 2, 0, 3)
        k, v = self.cached_kv(k, v)
        if kv is not None:
            end = step.start + s
            kv[0].narrow(2, step.start, s).copy_(k)
            kv[1].narrow(2, step.start, s).copy_(v)
            k, v = kv[0].narrow(2, 0, end), kv[1].narrow(2, 0, end)
        return self.linear_proj(cached_attention(q, k, v, step.mask))


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` in four ops: ``rotate_half(x) * sin`` is ``roll(x, d/2) * signed_sin`` with
    ``signed_sin = [-sin_1, sin_2]`` (the same products, so the same bits); ``cos`` and ``signed_sin`` come
    from :func:`rotary_tables`. For a head only partly rotated it falls back to :func:`apply_rotary`."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        sin = torch.cat((-signed_sin[..., : dim // 2], signed_sin[..., dim // 2 :]), dim=-1)
        return apply_rotary(x, cos, sin)
    return x * cos + x.roll(dim // 2, dims=-1) * signed_sin


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin) for :func:`rotate`, from RoPE's (cos, sin), once per step."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``softmax(QK^T / sqrt(d)) V`` of queries [s, b, groups, heads_per_group, d] over keys/values
    [b, groups, L, d] (the last ``s`` of the L slots are the queries' own); ``mask`` [b, 1, s, L] or None
    for causal. Returns [s, b, heads * d]."""
    s, b, groups, per_group, d = q.shape
    if s == 1:
        # One query per row (a decode step) sees every cached key, so no causal mask. Each group's
        # queries become the query rows of one attention over that group's keys: the cache is read in
        # place, never expanded to one copy per query head. A mask [b, 1, 1, L] broadcasts over them.
        out = F.scaled_dot_product_attention(q.reshape(b, groups, per_group, d), k, v, attn_mask=mask)
        return out.reshape(1, b, groups * per_group * d)
    if per_group > 1:
        k = k.repeat_interleave(per_group, dim=1)
        v = v.repeat_interleave(per_group, dim=1)
    q = q.reshape(s, b, groups * per_group, d).permute(1, 2, 0, 3)  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return out.permute(2, 0, 1, 3).reshape(s, b, groups * per_group * d)


class CoreAttention(nn.Module):
    """``softmax(QK^T / sqrt(d)) V`` with attention dropout: the part 'selective' recompute reruns.

    Takes ``q`` [s, b, heads, d] and ``k``, ``v`` [s, b, groups, d] (this rank's heads) and returns
    [s, b, heads * d]. The GQA expansion of k/v happens inside, so a checkpoint keeps only the
    unexpanded tensors.
    """

    def __init__(self, attention_dropout: float, queries_per_group: int, softmax_scale: Optional[float] = None):
        super().__init__()
        self.attention_dropout = attention_dropout
        self.q_per_group = queries_per_group
        self.softmax_scale = softmax_scale
        """None: 1/sqrt(d) of the queries' width d (multi-latent attention sets its own, and its values may be of
        another width than its queries and keys)."""

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rng: RNGStatesTracker,
        context: Optional[AttentionContext],
        recompute: bool,
    ) -> torch.Tensor:
        """This attention, checkpointed when ``recompute`` ('selective' recompute) and a backward follows."""
        if recompute and recompute_active(self):
            return checkpoint(self, q, k, v, rng, context, rng_tracker=rng)
        return self(q, k, v, rng, context)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rng: RNGStatesTracker,
        context: Optional[AttentionContext] = None,
    ) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        if context is not None and context.cp_size > 1:
            if dropout > 0.0:
                raise ValueError(
                    "attention_dropout > 0 with context parallelism: the context-parallel attention has "
                    "no dropout; set attention_dropout=0.0 or context_parallel_size=1"
                )
            dq, dv = q.shape[-1], v.shape[-1]
            if dv == dq:
                return context_parallel_attention(q, k, v, context, self.softmax_scale)
            # Values of another width than queries and keys (MLA): the blockwise kernels are written for one head
            # width, so all three are zero-padded to the wider one -- zero channels add nothing to a score (the
            # scale stays the queries') and give zero outputs, cut off afterwards.
            width, scale = max(dq, dv), self.softmax_scale or 1.0 / math.sqrt(dq)
            q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
            out = context_parallel_attention(q, k, v, context, scale)
            s, b, heads = q.shape[:3]
            return out.view(s, b, heads, width)[..., :dv].reshape(s, b, heads * dv)
        if context is not None and context.packed:
            # Heads are split over TP: each rank needs its own dropout stream.
            with rng.fork(MODEL_PARALLEL_RNG, q.device) if dropout > 0.0 else contextlib.nullcontext():
                return packed_attention(q, k, v, context, dropout, self.softmax_scale)
        s, b = q.shape[:2]
        if self.q_per_group > 1:
            k = k.repeat_interleave(self.q_per_group, dim=2)
            v = v.repeat_interleave(self.q_per_group, dim=2)
        # [s, b, n, d] -> [b, n, s, d] for SDPA
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        with rng.fork(MODEL_PARALLEL_RNG, q.device) if dropout > 0.0 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def scaled_init_std(config: GPTConfig) -> float:
    """Megatron's init for the output projections of residual branches: std / sqrt(2 L)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)
