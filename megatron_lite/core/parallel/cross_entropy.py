"""Cross entropy over logits split along the vocabulary (Megatron's vocab_parallel_cross_entropy).

The full logits are never gathered: the max, the target logit and the sum of exponentials are
all-reduced over the TP group, which keeps memory at ``V/tp`` per rank.

Vocabulary padding (see ``vocab_padding.py``) never takes part in the softmax: given the real
``vocab_size``, the padded entries are left out of the max and of the sum of exponentials (their
probability is exactly 0, so they get no gradient); a rank whose slice holds no padding runs exactly
the unpadded code.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.vocab_padding import local_real_vocab


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        real = local_real_vocab(vocab_local, vocab_start, vocab_size)
        if real == vocab_local:
            local_max = logits.max(dim=-1)[0]
        elif real > 0:
            local_max = logits[..., :real].max(dim=-1)[0]  # a view: the padding is skipped, not copied out
        else:  # this rank holds only padding: it cannot raise the max
            local_max = logits.new_full(logits.shape[:-1], float("-inf"))
        logits_max = _all_reduce(local_max, group, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = _all_reduce(predicted, group)
        exp_logits = logits.exp()
        if real < vocab_local:
            exp_logits[..., real:] = 0.0  # padding: probability 0 (and so no gradient)
        # Summed over the real entries only: the same additions in the same order as an unpadded model's.
        sum_exp = _all_reduce((exp_logits if real == vocab_local else exp_logits[..., :real]).sum(dim=-1), group)
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
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-token loss ``[...]`` from this rank's logits ``[..., V/tp]`` covering
    ``[vocab_start, vocab_start + V/tp)`` and targets ``[...]`` in the full vocabulary.

    ``vocab_size`` is the real vocabulary: logits at or past it (vocabulary padding) are left out of the
    softmax. None treats every logit as real (logits whose padding is already -inf need nothing more)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size)
