"""Autograd functions for the tensor- and sequence-parallel collectives (Megatron's mappings.py).

Each is the identity when its group is None (size 1), so the same model code runs alone.
Sequence-parallel activations are laid out ``[s, b, h]`` and sharded along dim 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch 2.13 renamed the single-tensor collectives; the old names still work on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
all_gather_into_tensor = _all_gather_single
"""``dist.all_gather_into_tensor`` under the name this torch release gives it (output: the inputs along dim 0)."""
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    out = torch.empty((x.shape[0] * n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[0] % n != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}")
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if _size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence. Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather the sequence. Backward: reduce-scatter (the consumer is tensor-parallel)
    or split (the consumer is replicated, e.g. the loss on gathered logits)."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    if group is None or not torch.is_grad_enabled():  # no backward to prepare (generation: every decode step)
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward. Without autograd ``x`` itself is reduced in place (callers pass
    a fresh layer output): no autograd node and no defensive copy on a decode step's critical path, and a
    small CPU tensor (a decode step's activations) is summed by :func:`sum_in_one_round`."""
    if group is None:
        return x
    if not torch.is_grad_enabled():
        if x.device.type == "cpu" and x.numel() * x.element_size() <= ONE_ROUND_SUM_BYTES:
            return sum_in_one_round(x, group)
        return _all_reduce(x, group)
    return _ReduceFromTensorParallel.apply(x, group)


ONE_ROUND_SUM_BYTES = 64 * 1024
"""Largest tensor (bytes per rank) :func:`reduce_from_tensor_parallel_region` sums by :func:`sum_in_one_round` rather
than all-reduce when forward-only on CPU. Up to it gloo's all-gather beat its all-reduce between 2 ranks on our
2-core machine (0.17 against 0.22 ms at 512 bytes, 0.18 against 0.22 at 64 KiB; at 1 MiB 1.1 against 0.57, where
the all-gather's n-fold bytes count)."""


def sum_in_one_round(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` summed over ``group``: all-gathered, then added up in rank order on every rank (no autograd).

    For the small tensors of a decode step the cost of a collective is its round trips, not its bytes: gloo's
    all-reduce (a reduce-scatter, then an all-gather) waits on two, an all-gather on one — half the latency of each
    of the ``2 x layers`` sums a tensor-parallel decode step waits on. Every rank adds the same tensors in the same
    order, so every rank gets the same bits; at two ranks they are the all-reduce's (``a + b == b + a``)."""
    n = _size(group)
    if n == 1:
        return x
    parts = _gather_first(x.reshape(1, -1), group)  # [n, numel]
    total = parts[0] + parts[1]
    for r in range(2, n):
        total += parts[r]
    return total.view(x.shape)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Split the last dim forward, all-gather backward."""
    return x if group is None else _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dim forward, split backward."""
    return x if group is None else _GatherFromTensorParallel.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Split dim 0 forward, all-gather backward."""
    return x if group is None else _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather dim 0 forward; reduce-scatter (or split) backward."""
    return x if group is None else _GatherFromSequenceParallel.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatter dim 0 forward, all-gather backward."""
    return x if group is None else _ReduceScatterToSequenceParallel.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """Forward: rows ``input_splits[j]`` go to rank j, ``output_splits[j]`` rows come from it. Backward: the same
    exchange reversed (an expert-parallel token dispatch and its combine)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _all_to_all(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Exchange rows of ``x`` over ``group`` with variable split sizes (differentiable; identity alone)."""
    return _AllToAll.apply(x, group, output_splits, input_splits)
