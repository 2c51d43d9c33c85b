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

    1. Replicated parameters whose gradient is partial per TP rank (see :func:`grad_is_partial_over_tp`)
       get it summed over TP.
    2. Dense gradients are summed over data (and context) parallel ranks, those of MoE experts over the
       expert-data-parallel ranks (the other copies of the same experts). The loss was already divided
       by the global token count, so the sum is the mean.
    """
    params = list(model.parameters())
    reduce_tp_partial_grads(params, layout)
    all_reduce_coalesced(_grads(p for p in params if not is_expert_parameter(p)), layout.group("dp_cp"))
    all_reduce_coalesced(_grads(p for p in params if is_expert_parameter(p)), layout.group("edp"))


def grad_is_partial_over_tp(param: torch.Tensor, sequence_parallel: bool) -> bool:
    """Whether the gradient of replicated ``param`` on one TP rank is only its part, to be summed over TP:
    under sequence parallelism for parameters that saw only this rank's slice of the sequence (norm
    weights, row-parallel biases: ``sequence_parallel_grad``), always for weights every attention head
    shares (this rank's heads only: ``tp_partial_grad``)."""
    return getattr(param, "tp_partial_grad", False) or (
        sequence_parallel and getattr(param, "sequence_parallel_grad", False)
    )


@torch.no_grad()
def reduce_tp_partial_grads(params: Iterable[torch.Tensor], layout: ParallelLayout) -> None:
    """Sum over TP the gradients :func:`grad_is_partial_over_tp` names. Works on FSDP's sharded gradients
    too: TP ranks at the same DP position hold the same shard, and the sums over TP and over DP commute."""
    if layout.tp_size == 1:
        return
    grads = _grads(p for p in params if grad_is_partial_over_tp(p, layout.sequence_parallel))
    all_reduce_coalesced([g.to_local() if hasattr(g, "to_local") else g for g in grads], layout.group("tp"))
