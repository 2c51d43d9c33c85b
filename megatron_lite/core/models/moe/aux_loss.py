"""The router's auxiliary losses (Megatron's formulas) and how their gradient joins the backward.

An auxiliary loss is not added to the language-model loss: it is *attached* to an activation of its layer
(:func:`attach_aux_loss`), an identity whose backward also hands the loss a gradient, so the loss reaches
the router's parameters in the same backward pass, scaled like the main loss. Our engine back-propagates
each microbatch's summed loss times a ``backward_scale`` and divides every gradient by the global token
count at the end (Megatron's ``calculate_per_token_loss``), so a loss that is a per-token mean is attached
with the multiplier ``backward_scale * num_local_tokens * tp_cp_size`` (see :func:`aux_loss_multiplier`).

Recomputation: the losses are computed by functions that save no tensor for their backward, so torch's
non-reentrant checkpoint finds the same saved tensors whether or not a recompute pass attaches them, and the
original pass's token counts are the ones its backward uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.mappings import reduce_from_tensor_parallel_region

if TYPE_CHECKING:
    from megatron_lite.core.models.moe.router import TopKRouter

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""The values of ``moe_router_load_balancing_type`` (a single string; Megatron's list form is not supported)."""
METRIC_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""The name each loss type is recorded under (Megatron's), divided by its coefficient; the z-loss is 'z_loss'."""


@dataclass
class AuxLossScope:
    """What one MoE layer's forward needs to attach and report its auxiliary losses."""

    tp_cp_group: Optional[dist.ProcessGroup] = None
    """Token counts of aux_loss/seq_aux_loss are summed here (None: alone)."""
    tp_dp_cp_group: Optional[dist.ProcessGroup] = None
    """Token counts of global_aux_loss are summed here (None: alone)."""
    backward_scale: float = 1.0
    """The engine's multiplier of this microbatch's backward (the loss scale, for one)."""
    record: Optional[Callable[[str, torch.Tensor], None]] = None
    """Metric sink: (name, detached 0-d value); None: record nothing. A load-balancing value is this rank's share
    (summed over the group that counted its tokens it is that group's loss); 'z_loss' is this rank's mean."""
    recomputing: bool = False
    """True in a (non-reentrant) activation-recompute pass: the same tensor computations, but nothing attached
    again, nothing recorded, nothing counted and no collective."""


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group``; None counts as a group of one."""
    return 1 if group is None else dist.get_world_size(group)


class _SwitchLoss(torch.autograd.Function):
    """``sum(probs.sum(0) * tokens_per_expert) * factor`` whose backward needs no saved tensor:
    d/d probs[t, e] = factor * tokens_per_expert[e], kept on the context (see the module's docstring)."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, tokens_per_expert: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.tokens_per_expert = tokens_per_expert.detach().clone()
        ctx.factor = factor
        ctx.probs_like = (probs.shape, probs.dtype)
        return torch.sum(probs.sum(dim=0) * tokens_per_expert) * factor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        shape, dtype = ctx.probs_like
        per_expert = (grad * ctx.factor) * ctx.tokens_per_expert
        return per_expert.to(dtype).expand(shape), None, None


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``coeff * E * sum_i f_i * P_i`` (Megatron's formula).

    ``f_i = tokens_per_expert[i] / (total_num_tokens * topk)`` is expert i's share of the routed slots,
    counted at the level wanted (microbatch, sequence or global batch); ``P_i = probs[:, i].sum() /
    total_num_tokens`` sums this rank's scores only, so the sum of the ranks' losses is the loss of all
    their tokens (sequence- and context-parallel ranks each hold a part of the tokens).
    """
    factor = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return _SwitchLoss.apply(probs, tokens_per_expert, factor)


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff * mean_tokens(logsumexp(logits) ** 2)`` keeps the logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def reduced_tokens_per_expert(routing_map: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Tokens routed to each expert ``[E]`` (or ``[columns]``), summed over ``group``'s ranks."""
    with torch.no_grad():
        return reduce_from_tensor_parallel_region(routing_map.sum(dim=0), group)


def aux_loss_multiplier(scope: AuxLossScope, num_local_tokens: int) -> float:
    """The backward multiplier of a per-token-mean auxiliary loss under per-token loss normalisation.

    The engine divides every gradient by the global token count, which is ``num_local_tokens * tp_cp_size``
    times (microbatches x data-parallel ranks); multiplying the loss by that factor leaves it averaged over
    microbatches and data-parallel ranks only, as without per-token normalisation (Megatron's derivation in
    ``attach_and_log_load_balancing_loss``)."""
    return scope.backward_scale * num_local_tokens * group_size(scope.tp_cp_group)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activation; its backward also gives the auxiliary loss the gradient ``multiplier``,
    as if ``multiplier * aux_loss`` had been added to the loss being back-propagated (Megatron's
    ``MoEAuxLossAutoScaler``, with the multiplier passed per call instead of held on the class)."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, aux_loss: torch.Tensor, multiplier: float) -> torch.Tensor:
        ctx.multiplier = multiplier
        ctx.loss_like = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return activation

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.loss_like
        return grad, torch.ones(shape, dtype=dtype, device=device) * ctx.multiplier, None


def attach_aux_loss(
    activation: torch.Tensor, aux_loss: torch.Tensor, multiplier: Union[float, torch.Tensor]
) -> torch.Tensor:
    """``activation`` unchanged, carrying ``aux_loss`` into the backward with gradient ``multiplier``."""
    if not aux_loss.requires_grad:
        return activation
    return _AttachAuxLoss.apply(activation, aux_loss, multiplier)


@torch.no_grad()
def update_expert_bias(routers: Iterable["TopKRouter"], group: Optional[dist.ProcessGroup]) -> None:
    """Aux-loss-free balancing, once per optimizer step (DeepSeek-V3; Megatron's ``_update_router_expert_bias``).

    Each router's ``local_tokens_per_expert`` is summed over ``group`` (TP x DP x CP: every rank that routed
    a part of the step's tokens), all routers in one all-reduce; then ``expert_bias += rate *
    sign(mean - count)`` raises the bias of under-loaded experts and lowers it for over-loaded ones, and the
    counts restart from zero. Routers without expert bias are skipped; routers in eval mode (a frozen
    teacher) keep their bias. Every rank of ``group`` must pass the same routers in the same order.
    """
    entries: list[tuple["TopKRouter", torch.Tensor, torch.Tensor]] = []
    for router in routers:
        if router.expert_bias is not None and router.local_tokens_per_expert is not None:
            entries.append((router, router.expert_bias, router.local_tokens_per_expert))
    if not entries:
        return
    counts = torch.stack([count for _, _, count in entries])
    if group is not None:
        dist.all_reduce(counts, group=group)
    mean = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
    for (router, bias, count), offset in zip(entries, torch.sign(mean - counts)):
        if router.training:
            bias.add_(offset * router.config.moe_router_bias_update_rate)
        count.zero_()
