"""Cross entropy over logits split along the vocabulary (Megatron's vocab_parallel_cross_entropy).

The full logits are never gathered: the max, the target logit and the sum of exponentials are
all-reduced over the TP group, which keeps memory at ``V/tp`` per rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        logits_max = _all_reduce(logits.max(dim=-1)[0], group, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _all_reduce(predicted, group)
        exp_logits = logits.exp()
        sum_exp = _all_reduce(exp_logits.sum(dim=-1), group)
        loss = sum_exp.log() - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup],
                                 vocab_start: int = 0) -> torch.Tensor:
    """Per-token loss ``[...]`` from this rank's logits ``[..., V/tp]`` covering
    ``[vocab_start, vocab_start + V/tp)`` and targets ``[...]`` in the full vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
