"""Which experts each token goes to, and with what weight: pure tensor functions (Megatron's ``moe_utils``).

Naming is Megatron's: *logits* come out of the router's linear layer; *scores* are the logits after the
score function; *probs* are the weights that combine the chosen experts' outputs, zero where a token is
not routed; *routing_map* is the boolean ``[tokens, experts]`` choice. Every function takes ``[T, E]``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""The score functions of ``moe_router_score_function``."""
DROP_POLICIES = ("probs", "position")
"""The values of ``moe_token_drop_policy``."""


def _routing_tensors(
    logits: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread the top-k ``probs`` at ``indices`` into dense ``[T, E]`` probs and the boolean routing map."""
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def _check_topk(topk: int, num_experts: int) -> None:
    if not 1 <= topk <= num_experts:
        raise ValueError(f"moe_router_topk={topk} must be between 1 and the number of experts ({num_experts})")


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to ``group_topk`` of ``num_groups`` equal groups of experts (DeepSeek's device- and
    node-limited routing: a group is the experts of one device or node). Returns (values, indices) ``[T, k]``.

    A group's score is the sum of its best ``topk // group_topk`` expert scores (Megatron's rule).
    """
    num_tokens, num_experts = scores.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"moe_router_num_groups={num_groups} must divide the number of experts ({num_experts})")
    if not 1 <= group_topk <= num_groups:
        raise ValueError(f"moe_router_group_topk={group_topk} must be between 1 and moe_router_num_groups={num_groups}")
    per_group = num_experts // num_groups
    if topk > group_topk * per_group:
        raise ValueError(
            f"moe_router_topk={topk} is more than the {group_topk * per_group} experts of the "
            f"{group_topk} selected groups; raise moe_router_group_topk or lower moe_router_topk"
        )
    grouped = scores.reshape(num_tokens, num_groups, per_group)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.repeat_interleave(per_group, dim=1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing (Megatron's ``topk_routing_with_score_function``): (probs, routing_map), each ``[T, E]``.

    - softmax, ``pre_softmax=False``: the k largest logits are chosen and softmaxed among themselves
      (the k weights sum to one; Mixtral). ``pre_softmax=True``: softmax over all experts, then the k
      largest probabilities, not renormalised (Qwen2-MoE).
    - sigmoid: per-expert sigmoid scores; with ``topk > 1`` the chosen k are renormalised to sum to one.
      ``expert_bias`` ``[E]`` (aux-loss-free balancing, DeepSeek-V3) is added to the scores for the choice
      only: the weights stay the unbiased scores.
    - ``num_groups``/``group_topk``: the choice is group-limited (:func:`group_limited_topk`).
    - ``scaling_factor``: multiplies the weights (DeepSeek's ``routed_scaling_factor``).

    Scores are computed in fp32 at least; probs come back in the logits' dtype.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    _check_topk(topk, logits.shape[1])
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"moe_router_score_function={score_function!r} must be one of {SCORE_FUNCTIONS}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("expert_bias (moe_router_enable_expert_bias) steers sigmoid scores only; softmax ignores it")
    if group_topk and not num_groups:
        raise ValueError("moe_router_group_topk needs moe_router_num_groups (how many groups the experts form)")

    def choose(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            assert num_groups is not None
            return group_limited_topk(values, topk, num_groups, group_topk)
        return values.topk(topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            top_logits, indices = choose(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            indices = choose(scores + expert_bias.float())[1]
            scores = scores.gather(1, indices)
        else:
            scores, indices = choose(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    return _routing_tensors(logits, indices, probs.type_as(logits))


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores) that the load-balancing losses measure: the scores over all experts (fp32;
    sigmoid scores normalised to sum to one per token) and their plain top-k. The losses balance what the
    router prefers, so neither the expert bias nor group limits take part (Megatron's choice)."""
    _check_topk(topk, logits.shape[1])
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function={score_function!r} must be one of {SCORE_FUNCTIONS}")
    indices = scores.topk(topk, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True), scores


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]``: rows and columns rescaled in turn until the column
    scales move less than ``tol`` on average (BASE layers' balanced assignment, as Megatron computes it)."""
    cost = torch.exp(cost)
    num_tokens, num_experts = cost.shape
    row_scale = torch.ones(num_tokens, device=cost.device, dtype=cost.dtype)
    col_scale = torch.ones(num_experts, device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    error: float | torch.Tensor = 1e9
    previous = col_scale
    while error > tol:
        row_scale = (1 / num_tokens) / (torch.sum(col_scale * cost, 1) + eps)
        col_scale = (1 / num_experts) / (torch.sum(row_scale.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(previous - col_scale))
        previous = col_scale
    return col_scale * cost * row_scale.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinkhorn load balancing (``moe_router_load_balancing_type='sinkhorn'``): (probs, routing_map).

    In training the experts are the top-k of the Sinkhorn-balanced logits (no gradient through the choice);
    in evaluation the top-k of the weights. The weights are sigmoid(logits) for ``topk == 1``, else the
    softmax over all experts, not renormalised over the chosen ones (Megatron's)."""
    _check_topk(topk, logits.shape[1])
    if topk == 1:
        weights = torch.sigmoid(logits)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            indices = sinkhorn(logits.float()).topk(topk, dim=1).indices
    else:
        indices = weights.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return weights * routing_map, routing_map


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None) -> int:
    """Tokens one expert takes: ``ceil(num_tokens / num_experts * capacity_factor)``, at least ``min_capacity``."""
    if capacity_factor <= 0:
        raise ValueError(f"moe_expert_capacity_factor={capacity_factor} must be positive (None means no dropping)")
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def apply_router_token_dropping(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cap every expert at ``get_capacity(T * router_topk, E, capacity_factor)`` tokens: (probs, routing_map).

    ``drop_policy='probs'`` keeps each expert's highest-weighted tokens, ``'position'`` its earliest ones.
    ``pad_to_capacity``: every expert gets exactly ``capacity`` tokens, the missing ones taken from tokens
    not routed to it, with weight 0 (static shapes for the dispatcher). When the capacity exceeds T nothing
    is dropped (and, padded, every expert takes every token), as in Megatron.

    Ties go to the earlier token (a stable sort): Megatron's ``torch.topk`` leaves them unspecified, so
    its 'position' policy is not guaranteed to keep the earliest tokens, nor which unrouted tokens pad.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"moe_token_drop_policy={drop_policy!r} must be one of {DROP_POLICIES}")
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        priority = probs if drop_policy == "probs" else routing_map.to(torch.int8)
        kept_tokens = torch.sort(priority, dim=0, descending=True, stable=True).indices[:capacity]
        keep = torch.zeros_like(routing_map).scatter(0, kept_tokens, True)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map
