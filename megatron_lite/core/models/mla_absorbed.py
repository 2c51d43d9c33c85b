"""Multi-latent attention over the cached latents themselves: the key and value up-projection absorbed.

The plain form expands every cached latent to each head's positionless key and value at every step
(``linear_kv_up_proj``: ``L x kv_lora_rank x heads x (qk_head_dim + v_head_dim)`` multiply-adds for ``L`` cached
tokens). Since ``k_nope = latent W_UK^T`` and ``v = latent W_UV^T`` per head (``W_UK`` [heads, qk_head_dim, r] and
``W_UV`` [heads, v_head_dim, r], this rank's rows of the up-projection's weight), the same attention is

    scores = (q_nope W_UK) latent^T + q_pos k_pos^T        (times the softmax scale, YaRN's included)
    out    = (softmax(scores) latent) W_UV^T

which reads the cache once for all heads (one latent per token, as multi-query attention does) and costs
``heads x s x (L x (2r + pos) + r x (qk_head_dim + v_head_dim))``: DeepSeek-V2's "absorbed" decode, as vLLM,
SGLang and Megatron's inference run it. It is slower where the queries are many and the cache short (a prefill:
the score and value products are ``r``-wide instead of ``qk_head_dim``/``v_head_dim``-wide), so
:func:`absorbs` picks the cheaper form per step by counting multiply-adds.

The weights are read at every step (views of the up-projection's weight, nothing precomputed that training could
make stale). A LoRA adapter on the up-projection (``scale x B A``) is absorbed in factored form, never merged:
``q_nope (W_UK + scale B_K A) = q_nope W_UK + scale (q_nope B_K) A``, and likewise on the value side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear

if TYPE_CHECKING:
    from megatron_lite.core.models.mla import MultiLatentAttention


def _lora_factors(layer: ColumnParallelLinear) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A [dim, r], this rank's B [rows, dim], scale) of an active LoRA adapter on ``layer``; None without one.
    Raises TypeError for an adapter that is not a plain LoRA (the caller then runs the plain form)."""
    adapter = layer.adapter
    if adapter is None or not getattr(adapter, "enabled", True):
        return None
    a, b, scale = (getattr(adapter, name, None) for name in ("linear_in", "linear_out", "scale"))
    dropping = adapter.training and bool(getattr(adapter, "dropout", 0.0))
    if a is None or b is None or not isinstance(scale, float) or dropping:
        raise TypeError(f"{type(adapter).__name__} on linear_kv_up_proj is not a LoRA adapter absorbable in eval mode")
    return a.weight, b.weight, scale


def why_not_absorbable(attention: MultiLatentAttention) -> Optional[str]:
    """Why ``attention``'s up-projection cannot be absorbed, or None when it can: its GEMM wrapped (quantization
    rounds the layer's input and weight, which the absorbed form does not see), or an adapter that is not LoRA."""
    layer = attention.linear_kv_up_proj
    if type(layer).linear is not ColumnParallelLinear.linear:
        return f"linear_kv_up_proj's GEMM is wrapped ({type(layer).__name__})"
    try:
        _lora_factors(layer)
    except TypeError as error:
        return str(error)
    return None


def absorbs(attention: MultiLatentAttention, queries: int, keys: int) -> bool:
    """Whether a step of ``queries`` new tokens per row attending ``keys`` slots runs absorbed: as
    ``attention.absorb`` says (True raises if the up-projection cannot be absorbed), or, when that is None,
    where it takes fewer multiply-adds per head than expanding the ``keys`` latents (the plain form)."""
    reason = why_not_absorbable(attention)
    if attention.absorb is not None:
        if attention.absorb and reason is not None:  # an adapter or a quantizer added after set_absorption(..., True)
            raise ValueError(f"absorb=True, but {reason}: set absorb=None (or False) to run the plain form")
        return attention.absorb
    if reason is not None:
        return False
    r, nope, pos, v = attention.kv_lora_rank, attention.nope, attention.pos, attention.v
    plain = keys * r * (nope + v) + queries * keys * (nope + pos + v)
    absorbed = queries * r * (nope + v) + queries * keys * (2 * r + pos)
    return absorbed < plain


def absorbed_attention(
    attention: MultiLatentAttention,
    q_nope: torch.Tensor,
    q_pos: torch.Tensor,
    latent: torch.Tensor,
    k_pos: torch.Tensor,
    mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """This rank's heads' attention outputs [b, heads, s, v_head_dim] of queries ``q_nope`` [s, b, heads,
    qk_head_dim] and rotated ``q_pos`` [s, b, heads, pos] over the cached latents [b, 1, L, kv_lora_rank] and
    rotated RoPE keys [b, 1, L, pos] (the last ``s`` slots are the queries' own); ``mask`` bool [b, 1, s, L]
    (True: may attend) or None for causal."""
    s, b, heads, nope = q_nope.shape
    r, length = attention.kv_lora_rank, latent.shape[2]
    up = attention.linear_kv_up_proj.weight.view(heads, nope + attention.v, r)
    w_uk, w_uv = up[:, :nope], up[:, nope:]  # [heads, nope, r], [heads, v, r]
    lora = _lora_factors(attention.linear_kv_up_proj)
    q_nope = q_nope.permute(1, 2, 0, 3)  # [b, heads, s, nope]
    q_latent = torch.matmul(q_nope, w_uk)  # [b, heads, s, r]
    if lora is not None:
        a, b_up, scale = lora
        b_k, b_v = b_up.view(heads, nope + attention.v, -1).split([nope, attention.v], dim=1)
        q_latent = q_latent + torch.matmul(torch.matmul(q_nope, b_k), a) * scale
    # Every head reads the same latents: the heads' queries become the rows of one product per batch row.
    q_latent = q_latent.reshape(b, heads * s, r)
    q_pos = q_pos.permute(1, 2, 0, 3).reshape(b, heads * s, -1)
    latent, k_pos = latent[:, 0], k_pos[:, 0]  # [b, L, r], [b, L, pos]
    scores = torch.baddbmm(torch.bmm(q_pos, k_pos.transpose(1, 2)), q_latent, latent.transpose(1, 2))
    softmax_scale = attention.core_attention.softmax_scale
    assert softmax_scale is not None  # MLA's is always set (YaRN's mscale in it)
    scores = scores.view(b, heads, s, length) * softmax_scale
    if s > 1 and mask is None:
        mask = torch.ones(s, length, dtype=torch.bool, device=scores.device).tril(length - s)
    if mask is not None:  # [b, 1, s, L] broadcasts over the heads
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
    out_latent = torch.bmm(probs.view(b, heads * s, length), latent).view(b, heads, s, r)
    out = torch.matmul(out_latent, w_uv.transpose(1, 2))  # [b, heads, s, v]
    if lora is not None:
        out = out + torch.matmul(torch.matmul(out_latent, a.t()), b_v.transpose(1, 2)) * scale
    return out
