"""Distillation KL over logits split along the vocabulary, the full vocabulary never gathered.

Per token ``T² · KL(softmax(t/T) ‖ softmax(s/T))`` (Hinton et al.: the T² keeps the gradient's size
independent of the temperature) for teacher logits ``t`` and student logits ``s``, each TP rank holding the
same vocabulary slice of both. Like ``vocab_parallel_cross_entropy`` only per-token scalars cross the TP
group: the two maxima (MAX all-reduce), the two sums of exponentials and the KL's partial sums (SUM
all-reduces). Vocabulary padding (``vocab_padding.py``) takes no part: its entries are out of every max and
sum, and get no gradient. The teacher is a constant: its logits get no gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.vocab_padding import local_real_vocab


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _log_softmax(logits: torch.Tensor, group) -> torch.Tensor:
    """log-softmax over the vocabulary split across ``group`` (``logits``: this rank's real entries; a rank
    holding only padding passes an empty last dim)."""
    if logits.shape[-1] > 0:
        local_max = logits.max(dim=-1)[0]
    else:  # only padding here: it cannot raise the max
        local_max = logits.new_full(logits.shape[:-1], float("-inf"))
    shifted = logits - _all_reduce(local_max, group, dist.ReduceOp.MAX).unsqueeze(-1)
    sum_exp = _all_reduce(shifted.exp().sum(dim=-1), group)
    return shifted - sum_exp.log().unsqueeze(-1)


class _VocabParallelKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, group, vocab_start, vocab_size, temperature):
        vocab_local = student.shape[-1]
        real = local_real_vocab(vocab_local, vocab_start, vocab_size)
        # Views of the real entries (the padding is skipped, not copied out); fp32 whatever the logits' dtype.
        log_p_s = _log_softmax(student[..., :real].float() / temperature, group)
        log_p_t = _log_softmax(teacher[..., :real].float() / temperature, group)
        p_t = log_p_t.exp()
        kl = _all_reduce((p_t * (log_p_t - log_p_s)).sum(dim=-1), group) * temperature**2
        # d(T²·KL)/ds = T·(softmax(s/T) − softmax(t/T)); kept instead of both softmaxes (one V/tp tensor).
        grad = student.new_zeros(student.shape, dtype=torch.float32)
        grad[..., :real] = (log_p_s.exp() - p_t) * temperature
        ctx.save_for_backward(grad)
        ctx.student_dtype = student.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        (grad,) = ctx.saved_tensors
        return (grad * grad_kl.unsqueeze(-1)).to(ctx.student_dtype), None, None, None, None, None


def vocab_parallel_kl_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token ``T² · KL(softmax(teacher/T) ‖ softmax(student/T))`` ``[...]`` (fp32) from this rank's logits
    ``[..., V/tp]`` of both models, which cover ``[vocab_start, vocab_start + V/tp)`` of the same padded
    vocabulary. ``vocab_size`` is the real vocabulary: entries at or past it (padding) are left out (None:
    every entry is real). Differentiable in the student's logits only; collective over ``group``."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: both models must share the (padded) vocabulary "
            f"and see the same tokens"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelKL.apply(
        student_logits, teacher_logits.detach(), group, vocab_start, vocab_size, float(temperature)
    )
