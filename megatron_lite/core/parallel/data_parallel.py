"""Gradient reduction after the backward passes of a step (Megatron's finalize_model_grads).

Coalesced into flat buffers so that a step issues a few large collectives, not one per parameter.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import is_expert_parameter

_BUCKET_BYTES = 40 * 1024 * 1024


def all_reduce_coalesced(grads: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        bucket, size = [], 0
        for g in same_dtype:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= _BUCKET_BYTES:
                _reduce_bucket(bucket, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: list[torch.Tensor], group) -> None:
    flat = _flatten_dense_tensors(bucket)
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
        g.copy_(reduced)


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.requires_grad and p.grad is not None]


@torch.no_grad()
def finalize_model_grads(model: nn.Module, layout: ParallelLayout) -> None:
    """Make every rank's gradients the gradients of the global-batch loss.

    1. Replicated parameters whose gradient is partial per TP rank (see :func:`partial_grad_group`)
       get it summed over TP (experts' over ETP).
    2. Dense gradients are summed over data (and context) parallel ranks, those of MoE experts over the
       expert-data-parallel ranks (the other copies of the same experts). The loss was already divided
       by the global token count, so the sum is the mean.
    """
    params = list(model.parameters())
    reduce_tp_partial_grads(params, layout)
    all_reduce_coalesced(_grads(p for p in params if not is_expert_parameter(p)), layout.group("dp_cp"))
    all_reduce_coalesced(_grads(p for p in params if is_expert_parameter(p)), layout.group("edp"))


def partial_grad_group(param: torch.Tensor, sequence_parallel: bool) -> Optional[str]:
    """The layout group over which the gradient of ``param`` on one rank is only its part, to be summed: None when
    it is whole. A replicated dense parameter's is partial over 'tp' under sequence parallelism when it saw only
    this rank's slice of the sequence (norm weights, row-parallel biases: ``sequence_parallel_grad``), and always
    for weights every attention head shares (this rank's heads only: ``tp_partial_grad``). An expert's replicated
    parameter marked ``tp_partial_grad`` is partial over 'etp' (the experts' tensor-parallel group, which need not
    be TP: fc2's bias, LoRA's adapters on the experts); the experts see whole tokens, so SP never splits theirs."""
    if is_expert_parameter(param):
        return "etp" if getattr(param, "tp_partial_grad", False) else None
    partial = getattr(param, "tp_partial_grad", False) or (
        sequence_parallel and getattr(param, "sequence_parallel_grad", False)
    )
    return "tp" if partial else None


def reduce_partial_grads(grads: Iterable[tuple[torch.Tensor, torch.Tensor]], layout: ParallelLayout) -> None:
    """Sum each (parameter, gradient) pair's gradient over the group :func:`partial_grad_group` names (dense
    parameters over TP first, then experts' over ETP: every rank of a group issues its collectives in one order)."""
    by_group: dict[str, list[torch.Tensor]] = {"tp": [], "etp": []}
    for param, grad in grads:
        group = partial_grad_group(param, layout.sequence_parallel)
        if group is not None:
            by_group[group].append(grad.to_local() if hasattr(grad, "to_local") else grad)
    for name, members in by_group.items():
        all_reduce_coalesced(members, layout.group(name))


@torch.no_grad()
def reduce_tp_partial_grads(params: Iterable[torch.Tensor], layout: ParallelLayout) -> None:
    """Sum over TP (an expert's over ETP) the gradients :func:`partial_grad_group` names. Works on FSDP's sharded
    gradients too: TP ranks at the same DP position hold the same shard, and the sums over TP and over DP commute."""
    reduce_partial_grads(((p, p.grad) for p in params if p.requires_grad and p.grad is not None), layout)
