"""The vocab-parallel distillation KL is the single-process KL: ``T²·KL(softmax(t/T) ‖ softmax(s/T))`` per
token equals torch's ``kl_div`` on the full real vocabulary, forward and gradient, alone (with padding that
must be ignored) and split over 2 forked gloo ranks whose second rank holds part real entries, part padding."""

import torch
import torch.nn.functional as F
from spawn_utils import run_ranks

from megatron_lite.core.parallel.vocab_parallel_kl import vocab_parallel_kl_divergence

VOCAB, PADDED, T = 100, 128, 2.0  # rank 1 of 2 holds rows 64..127: 36 real, 28 padding


def _logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64) * 3
    teacher = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64) * 3
    student[..., VOCAB:] = 0.0  # what padded output rows give (zero weights): must not count
    teacher[..., VOCAB:] = float("-inf")  # what a model's masked logits hold there
    return student, teacher


def _reference(student: torch.Tensor, teacher: torch.Tensor, upstream: torch.Tensor):
    s = student[..., :VOCAB].clone().requires_grad_(True)
    kl = (
        F.kl_div(
            F.log_softmax(s / T, -1), F.log_softmax(teacher[..., :VOCAB] / T, -1), log_target=True, reduction="none"
        ).sum(-1)
        * T**2
    )
    (kl * upstream).sum().backward()
    return kl.detach(), s.grad


def _upstream() -> torch.Tensor:
    return torch.rand(3, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def test_single_process_kl_equals_torch_and_ignores_padding():
    student, teacher = _logits(0)
    kl_ref, grad_ref = _reference(student, teacher, _upstream())
    s = student.clone().requires_grad_(True)
    kl = vocab_parallel_kl_divergence(s, teacher, None, 0, VOCAB, temperature=T)
    (kl * _upstream()).sum().backward()
    torch.testing.assert_close(kl, kl_ref.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.grad[..., :VOCAB], grad_ref, rtol=1e-5, atol=1e-7)
    assert s.grad[..., VOCAB:].abs().max() == 0  # padding gets no gradient
    same = vocab_parallel_kl_divergence(teacher.nan_to_num(neginf=0.0), teacher, None, 0, VOCAB)
    assert same.abs().max() < 1e-6  # KL(p ‖ p) = 0


def _kl_on_rank(rank: int, world_size: int):
    group = torch.distributed.group.WORLD
    student, teacher = _logits(0)
    width = PADDED // world_size
    shard = slice(rank * width, (rank + 1) * width)
    s = student[..., shard].clone().requires_grad_(True)
    kl = vocab_parallel_kl_divergence(s, teacher[..., shard], group, rank * width, VOCAB, temperature=T)
    (kl * _upstream()).sum().backward()
    return kl.detach(), s.grad


def test_tp2_kl_and_gradient_equal_the_single_process_kl():
    student, teacher = _logits(0)
    kl_ref, grad_ref = _reference(student, teacher, _upstream())
    (kl0, g0), (kl1, g1) = run_ranks(_kl_on_rank, 2)
    torch.testing.assert_close(kl0, kl_ref.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl1, kl0, rtol=0, atol=0)  # every TP rank holds the same per-token KL
    grad = torch.cat([g0, g1], -1)
    torch.testing.assert_close(grad[..., :VOCAB], grad_ref, rtol=1e-5, atol=1e-7)
    assert grad[..., VOCAB:].abs().max() == 0
