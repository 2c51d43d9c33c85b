"""Multi-latent attention (DeepSeek-V2/V3; Megatron's ``MLASelfAttention``), tensor- and sequence-parallel.

Keys and values come from one compressed latent per token: ``linear_kv_down_proj`` maps the hidden state to the
latent (``kv_lora_rank``) and a RoPE key part (``qk_pos_emb_head_dim``) shared by every head; the latent is
normalized and ``linear_kv_up_proj`` expands it to each head's positionless key (``qk_head_dim``) and value
(``v_head_dim``). Queries come from the hidden state (``linear_q_proj``) or through a compressed latent of their
own (``linear_q_down_proj`` -> ``q_layernorm`` -> ``linear_q_up_proj``, with ``q_lora_rank``). RoPE rotates only the
positional part of queries and keys ("decoupled RoPE"); a head's query/key is ``[positionless; rotated]``.

Tensor parallelism (as Megatron): the heads split over TP -- the up-projections column-parallel, the output
projection row-parallel -- and the down-projections replicated. Under sequence parallelism the replicated
down-projections and latent norms run on this rank's slice of the sequence (their weight gradients are partial
over TP, summed like a norm's); the column-parallel up-projections gather the sequence, and the shared RoPE key
is gathered explicitly. Without it their input gradient comes back whole through the up-projections' all-reduce
and the RoPE key's (:func:`copy_to_tensor_parallel_region`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.attention import CoreAttention, rotate
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.mla_absorbed import absorbed_attention, absorbs, why_not_absorbable
from megatron_lite.core.models.norms import Norm
from megatron_lite.core.models.rope import apply_rotary
from megatron_lite.core.parallel.context_parallel import AttentionContext
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from megatron_lite.core.parallel.random import RNGStatesTracker
from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_parameter


class ReplicatedLinear(nn.Module):
    """``Y = X A^T`` with ``A`` whole on every TP rank (MLA's down-projections, Megatron's 'duplicated' linear):
    under sequence parallelism each rank multiplies its own tokens, so the weight's gradient is partial over TP.

    ``adapter``: a module whose output is added to the layer's (LoRA, ``megatron_lite.core.peft``), called with the
    layer's input and whether the layer runs sequence-parallel, as on the tensor-parallel linears; None adds nothing."""

    adapter: Optional[nn.Module]

    def __init__(self, input_size: int, output_size: int, layout: ParallelLayout, init_std: float):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = layout.sequence_parallel
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(output_size, input_size)),
            ("normal", init_std),
            sequence_parallel_grad=layout.sequence_parallel,
        )
        self.register_module("adapter", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        adapter = self.adapter
        if adapter is not None and getattr(adapter, "enabled", True):
            y = y + adapter(x, self.sequence_parallel)
        return y


class MultiLatentAttention(nn.Module):
    """Causal multi-latent self-attention over ``[s(/tp), b, h]`` activations (this rank's heads)."""

    def __init__(self, config: GPTConfig, layout: ParallelLayout, output_init_std: float):
        super().__init__()
        # resolved and checked by GPTConfig._validate_mla
        assert config.kv_lora_rank and config.qk_head_dim and config.qk_pos_emb_head_dim and config.v_head_dim
        heads, h, std = config.num_attention_heads, config.hidden_size, config.init_method_std
        self.heads = heads // layout.tp_size
        self.nope, self.pos, self.v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.tp_group = layout.group("tp")
        self.sequence_parallel = layout.sequence_parallel
        q_width = heads * (self.nope + self.pos)
        norm = (config.normalization, config.layernorm_epsilon, layout.sequence_parallel)
        self.linear_q_proj: Optional[ColumnParallelLinear] = None
        self.linear_q_down_proj: Optional[ReplicatedLinear] = None
        self.q_layernorm: Optional[Norm] = None
        self.linear_q_up_proj: Optional[ColumnParallelLinear] = None
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_width, layout, bias=False, init_std=std)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, layout, std)
            self.q_layernorm = Norm(config.normalization, config.q_lora_rank, *norm[1:])
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_width, layout, bias=False, init_std=std)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.pos, layout, std)
        self.kv_layernorm = Norm(config.normalization, self.kv_lora_rank, *norm[1:])
        self.linear_kv_up_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.nope + self.v), layout, bias=False, init_std=std
        )
        self.linear_proj = RowParallelLinear(heads * self.v, h, layout, bias=False, init_std=output_init_std)
        scaling = config.rope_scaling()
        softmax_scale = (scaling.softmax_scale_factor() if scaling is not None else 1.0) / math.sqrt(
            self.nope + self.pos
        )
        self.core_attention = CoreAttention(config.attention_dropout, 1, softmax_scale)
        self.recompute_core_attention = config.recomputes("core_attn")
        self.absorb: Optional[bool] = None
        """How generation steps attend (``mla_absorbed.py``): None picks, per step, the form with fewer
        multiply-adds (absorbed for decode steps, plain for a prefill); True or False forces absorbed or plain
        (:func:`set_absorption`)."""

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [s(/tp), b, h] -> this rank's heads' queries [s, b, heads, qk_head_dim] and [.., qk_pos_emb_head_dim]
        (not yet rotated)."""
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            assert self.linear_q_down_proj is not None and self.q_layernorm is not None
            assert self.linear_q_up_proj is not None  # built together with q_lora_rank
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        s, b = q.shape[:2]
        q_nope, q_pos = q.view(s, b, self.heads, self.nope + self.pos).split([self.nope, self.pos], dim=-1)
        return q_nope, q_pos

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [s(/tp), b, h] -> the normalized latent [s(/tp), b, kv_lora_rank] and the RoPE key [s(/tp), b,
        qk_pos_emb_head_dim] (not yet rotated): what a generation's KV cache holds."""
        latent, k_pos = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos], dim=-1)
        return self.kv_layernorm(latent), k_pos

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent [..., kv_lora_rank] -> this rank's heads' positionless keys [..., heads, qk_head_dim] and
        values [..., heads, v_head_dim]."""
        kv = self.linear_kv_up_proj(latent)
        k_nope, v = kv.view(*kv.shape[:-1], self.heads, self.nope + self.v).split([self.nope, self.v], dim=-1)
        return k_nope, v

    def queries_keys_values(
        self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [s(/tp), b, h] -> q, k [s, b, heads, qk_head_dim + qk_pos_emb_head_dim] and v [s, b, heads,
        v_head_dim] of this rank's heads, RoPE applied to the positional parts."""
        q_nope, q_pos = self.queries(x)
        latent, k_pos = self.latent(x)
        k_nope, v = self.expand(latent)
        s, b = q_nope.shape[:2]
        # The RoPE key is every head's: its gradient is partial over the TP ranks' heads, summed on the way back.
        if self.sequence_parallel:
            k_pos = gather_from_sequence_parallel_region(k_pos, self.tp_group)
        else:
            k_pos = copy_to_tensor_parallel_region(k_pos, self.tp_group)
        k_pos = k_pos.unsqueeze(2)  # [s, b, 1, pos]
        if rope is not None:
            q_pos, k_pos = apply_rotary(q_pos, *rope), apply_rotary(k_pos, *rope)
        q = torch.cat([q_nope, q_pos], dim=-1)
        k = torch.cat([k_nope, k_pos.expand(s, b, self.heads, self.pos)], dim=-1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        rng: RNGStatesTracker,
        context: Optional[AttentionContext] = None,
    ) -> torch.Tensor:
        q, k, v = self.queries_keys_values(x, rope)
        return self.linear_proj(self.core_attention.run(q, k, v, rng, context, self.recompute_core_attention))

    # --- generation: beside the training path -----------------------------------------------
    def inference_forward(self, x: torch.Tensor, rope, kv: Optional[tuple[torch.Tensor, torch.Tensor]], step):
        """Attention of this step's tokens ``x`` [s, b, h] through a latent cache (``kv``: this layer's latent
        [b, 1, max_len, kv_lora_rank] and rotated RoPE key [b, 1, max_len, qk_pos_emb_head_dim] buffers, see
        :class:`~megatron_lite.core.inference.kv_cache.KVCache`; None: this step's tokens only). ``rope`` is
        (cos, signed_sin) [s, b, 1, 1, dim] of :func:`~megatron_lite.core.models.attention.rotary_tables`.

        A decode step attends the cached latents directly, the up-projection absorbed into the query and the output
        (``mla_absorbed.py``); a prefill expands them to keys and values (the plain form, cheaper there)."""
        q_nope, q_pos = self.queries(x)
        latent, k_pos = self.latent(x)
        s, b = q_nope.shape[:2]
        k_pos = k_pos.unsqueeze(2)  # [s, b, 1, pos]
        if rope is not None:
            cos, signed_sin = (t.squeeze(3) for t in rope)  # [s, b, 1, dim]
            q_pos, k_pos = rotate(q_pos, cos, signed_sin), rotate(k_pos, cos, signed_sin)
        latent, k_pos = latent.transpose(0, 1).unsqueeze(1), k_pos.permute(1, 2, 0, 3)  # [b, 1, s, r], [b, 1, s, pos]
        if kv is not None:
            end = step.start + s
            kv[0].narrow(2, step.start, s).copy_(latent)
            kv[1].narrow(2, step.start, s).copy_(k_pos)
            latent, k_pos = kv[0].narrow(2, 0, end), kv[1].narrow(2, 0, end)
        if absorbs(self, s, latent.shape[2]):
            out = absorbed_attention(self, q_nope, q_pos, latent, k_pos, step.mask)
        else:
            out = self._expanded_attention(q_nope, q_pos, latent, k_pos, step.mask)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v))

    def _expanded_attention(
        self,
        q_nope: torch.Tensor,
        q_pos: torch.Tensor,
        latent: torch.Tensor,
        k_pos: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The plain form of :func:`~megatron_lite.core.models.mla_absorbed.absorbed_attention` (same arguments and
        result): the latents expanded to every head's keys and values."""
        s, b = q_nope.shape[:2]
        k_nope, v = self.expand(latent[:, 0])  # [b, L, heads, nope], [b, L, heads, v]
        length = k_nope.shape[1]
        k = torch.cat([k_nope, k_pos.transpose(1, 2).expand(b, length, self.heads, self.pos)], dim=-1)
        q = torch.cat([q_nope, q_pos], dim=-1).permute(1, 2, 0, 3)  # [b, heads, s, d]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, L, d]
        # one query per row (a decode step) sees every cached slot; a prefill is causal unless a mask says more
        causal = s > 1 and mask is None
        scale = self.core_attention.softmax_scale
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def set_absorption(model: nn.Module, absorb: Optional[bool]) -> None:
    """Set every multi-latent attention layer of ``model`` to run its generation steps absorbed (True), plain
    (False), or whichever takes fewer multiply-adds per step (None, the default). True is refused, before any layer is
    set, where a layer's up-projection cannot be absorbed (:func:`~megatron_lite.core.models.mla_absorbed.absorbs`)."""
    layers = [module for module in model.modules() if isinstance(module, MultiLatentAttention)]
    reasons = [reason for layer in layers if (reason := why_not_absorbable(layer)) is not None] if absorb else []
    if reasons:
        raise ValueError(f"absorb=True, but {reasons[0]}: set absorb=None (or False) to run the plain form")
    for layer in layers:
        layer.absorb = absorb
