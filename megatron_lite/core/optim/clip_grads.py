"""Global gradient norm and clipping across every model-parallel shard (Megatron's clip_grads)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import is_tensor_parallel


def _counts_here(param: torch.Tensor, layout: ParallelLayout) -> bool:
    # A replicated parameter has the same gradient on every TP (and CP) rank: count it once.
    if layout.cp_rank != 0:
        return False
    return is_tensor_parallel(param) or layout.tp_rank == 0


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], layout: ParallelLayout) -> torch.Tensor:
    """L2 norm of the full model's gradient (every shard on every model-parallel rank, once)."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    params = [p for p in params if p.grad is not None]
    grads = [p.grad.detach() for p in params if _counts_here(p, layout)]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        # One fused kernel per dtype/device instead of a temporary per gradient.
        norms = torch._foreach_norm(grads, 2.0)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    group = layout.group("mp")
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, layout: ParallelLayout) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm`` (0 disables); returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, layout)
    if max_norm > 0 and params:
        # Always multiply by the clamped coefficient: no host-device sync to decide whether to clip.
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef.to(params[0].grad.device))
    return norm
