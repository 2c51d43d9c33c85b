"""Global gradient norm and clipping across every shard (Megatron's clip_grads).

One norm over the whole model: every tensor-parallel shard, every data-parallel shard (distributed
optimizer, FSDP), every expert shard, each replicated gradient counted exactly once.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import is_expert_parameter, is_tensor_parallel


def replicated_norm_group(layout: ParallelLayout) -> tuple[Optional[dist.ProcessGroup], bool]:
    """(group, over every rank) to sum the squared norm over when every rank holds whole (reduced) gradients:
    one model replica ('mp': PP x CP x TP), or every rank when the experts are folded differently from the dense
    layers (their replicas, over EDP, are not the dense ones, over DP x CP: no group smaller than the world holds
    one copy of each, so :func:`counts_in_norm` picks one replica of each and one scalar is summed over all)."""
    if layout.experts_folded:
        return None, True
    return layout.group("mp"), False


def counts_in_norm(model_param: torch.Tensor, layout: ParallelLayout, sliced_over_dp: bool = False) -> bool:
    """Whether this rank's copy of ``model_param``'s gradient enters the global norm, so that each distinct piece
    is counted once over the ranks the norm is summed over (:func:`replicated_norm_group`, or every rank).

    A dense gradient is the same on every DP x CP rank and, for a replicated parameter, on every TP rank; an
    expert's is the same on every expert-DP rank and, when not split over ETP, on every ETP rank. The last
    pipeline stage's copy of a tied embedding is counted on the first stage. ``sliced_over_dp``: the caller holds
    disjoint slices over the gradient's reduction group (DP x CP, or expert-DP: the distributed optimizer, FSDP),
    so every rank of it counts its own and the norm is summed over every rank."""
    if getattr(model_param, "pipeline_duplicate", False):
        return False
    expert = is_expert_parameter(model_param)
    if not sliced_over_dp:
        if layout.experts_folded:  # summed over every rank: one DP x CP (dense) or EDP (expert) replica
            if (layout.edp_rank != 0) if expert else (layout.dp_rank != 0 or layout.cp_rank != 0):
                return False
        elif layout.cp_rank != 0:  # summed over PP x CP x TP; experts replicated like dense weights
            return False
    return is_tensor_parallel(model_param) or (layout.etp_rank if expert else layout.tp_rank) == 0


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP gradients are DTensors over the data-parallel mesh: the local shard is what this rank owns.
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def grad_norm_of(
    grads: list[torch.Tensor], group: Optional[dist.ProcessGroup], device: torch.device, all_ranks: bool = False
) -> torch.Tensor:
    """L2 norm of ``grads`` summed in squares over ``group`` (or over every rank with ``all_ranks``)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    grads = [_local(g) for g in grads]
    grads = [g for g in grads if g.numel() > 0]
    if grads:
        # One fused kernel per dtype/device instead of a temporary per gradient.
        norms = torch._foreach_norm(grads, 2.0)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    if all_ranks:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)
    elif group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], layout: ParallelLayout) -> torch.Tensor:
    """L2 norm of the full model's gradient when gradients are replicated over DP (plain DP)."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    grads = [p.grad.detach() for p in params if p.grad is not None and counts_in_norm(p, layout)]
    group, all_ranks = replicated_norm_group(layout)
    return grad_norm_of(grads, group, device, all_ranks=all_ranks)


@torch.no_grad()
def scale_grads(grads: Iterable[Optional[torch.Tensor]], factor: torch.Tensor) -> None:
    """Multiply every gradient in place by a 0-d ``factor`` (no host sync); None entries are skipped."""
    local = [_local(g) for g in grads if g is not None]
    if local:
        torch._foreach_mul_(local, factor.to(device=local[0].device, dtype=torch.float32))


@torch.no_grad()
def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / norm)``: always multiplied in, so no host-device sync decides whether to clip."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, layout: ParallelLayout) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm`` (0 disables); returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, layout)
    if max_norm > 0 and params:
        scale_grads([p.grad for p in params], clip_coefficient(norm, max_norm))
    return norm
