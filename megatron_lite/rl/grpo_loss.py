"""The GRPO objective as plain PyTorch functions (DESIGN §3 "GRPO"; Megatron RL's ``calculate_grpo_loss``).

Per response token, with ``ρ = exp(log π − log π_old)`` and the group-normalized advantage ``A`` of the token's
sequence::

    loss = −w · min(ρA, clip(ρ, 1 − ε_lo, 1 + ε_hi)·A) + β·(e^Δ − Δ − 1) − c_H·H,   Δ = log π_ref − log π

``w`` is the truncated importance-sampling weight ``min(exp(log π_old − log π_sampler), cap)`` that corrects
for the sampler's log-probs differing from the trainer's (kernels, precision), ``e^Δ − Δ − 1`` the k3
estimator of KL(π ‖ π_ref) and ``H`` the token's entropy. The engine divides the summed loss by the global
number of loss units (tokens, or sequences with ``per_sequence``), summed over every data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.mappings import reduce_from_tensor_parallel_region


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Advantages ``(r − mean_g) / (std_g + eps)`` of ``rewards`` [n] laid out as consecutive groups of
    ``group_size`` samples of one prompt (population std; ``scale=False`` is Dr.GRPO's ``r − mean_g``). A group
    whose rewards are all equal gets advantage 0 for every sample, whatever ``scale``."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (advantages compare samples of one prompt), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    # Exactly zero where the group has no variance (the mean of equal floats can differ from them by rounding).
    centred = centred.masked_fill(~nonzero_variance_groups(rewards, group_size).unsqueeze(1), 0.0)
    return centred.view(-1).to(torch.float32)


def nonzero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group, True where its samples' rewards are not all equal (the groups that carry a learning signal)."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def truncated_is_weights(
    old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, cap: Optional[float]
) -> torch.Tensor:
    """Per token ``min(exp(log π_old − log π_sampler), cap)`` (truncated importance sampling; no gradient);
    ones when ``cap`` is None."""
    if cap is None:
        return torch.ones_like(old_log_probs)
    return torch.exp(old_log_probs.detach() - sampler_log_probs.detach()).clamp(max=cap)


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per token ``e^Δ − Δ − 1`` with ``Δ = log π_ref − log π``: an unbiased, non-negative estimate of
    KL(π ‖ π_ref) from samples of π (Schulman's k3)."""
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1.0


@dataclass
class TokenLoss:
    """Per-token terms of the GRPO loss ([b, s] each) and the clipping indicators."""

    loss: torch.Tensor
    """The per-token loss (policy term + KL − entropy bonus)."""
    kl: torch.Tensor
    """k3 KL to the reference (zeros without one)."""
    clipped_low: torch.Tensor
    """1.0 where A < 0 and ρ < 1 − ε_lo: the lower clip bound is the active term (no gradient)."""
    clipped_high: torch.Tensor
    """1.0 where A > 0 and ρ > 1 + ε_hi: the upper clip bound is the active term (no gradient)."""


def grpo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_log_probs: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    is_weights: Optional[torch.Tensor] = None,
) -> TokenLoss:
    """The per-token GRPO loss of ``log_probs`` [b, s] (with gradient) given the rollout's ``old_log_probs``,
    per-sequence ``advantages`` [b] (or per token [b, s]) and optional reference log-probs, entropy and IS weights."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == log_probs.dim() - 1 else advantages
    ratio = torch.exp(log_probs - old_log_probs.detach())
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    policy = -torch.minimum(ratio * adv, clipped * adv)
    if is_weights is not None:
        policy = policy * is_weights.detach()
    kl = torch.zeros_like(policy)
    if ref_log_probs is not None and beta != 0.0:
        kl = k3_kl(log_probs, ref_log_probs.detach())
    loss = policy + beta * kl
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy
    with torch.no_grad():
        low = ((ratio < 1.0 - clip_eps_low) & (adv < 0)).to(policy.dtype)
        high = ((ratio > 1.0 + clip_eps_high) & (adv > 0)).to(policy.dtype)
    return TokenLoss(loss=loss, kl=kl.detach(), clipped_low=low, clipped_high=high)


def reduce_token_loss(
    per_token: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of loss units, number of units) of one microbatch, for the engine to divide by the global count.

    Token-level (default): every response token of the global batch weighs the same. ``per_sequence``: each
    sequence's mean over its response tokens is one unit (a sequence without response tokens counts for none)."""
    mask = mask.to(per_token.dtype)
    if not per_sequence:
        return (per_token * mask).sum(), mask.sum()
    tokens = mask.sum(dim=-1)
    has = tokens > 0
    means = (per_token * mask).sum(dim=-1) / tokens.clamp(min=1.0)
    return (means * has).sum(), has.to(per_token.dtype).sum()


def vocab_parallel_entropy(logits: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Entropy ``[...]`` of the softmax over the whole vocabulary from this TP rank's logits ``[..., V/tp]``
    (padding entries at −inf take no part), differentiable; the full logits are never gathered."""
    logits = logits.float()
    with torch.no_grad():
        top = logits.max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))  # 0·(−inf) would be NaN
    total = reduce_from_tensor_parallel_region(exp.sum(dim=-1), group)
    weighted = reduce_from_tensor_parallel_region((exp * finite).sum(dim=-1), group)
    return total.log() - weighted / total
