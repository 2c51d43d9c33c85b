"""Vocabulary padding kept out of every output: which of a rank's logits are real, masking the rest, and
gathering the real vocabulary across TP.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x tp`` so that it splits
evenly over TP (and matmuls get friendly sizes). The padding depends on the TP size, so it must never
reach a softmax, a max or an output: then the same seed is the same model at any TP size. Which entries
are padding is known from Python integers (no host sync), and a rank whose slice holds no padding does no
extra work.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def local_real_vocab(vocab_local: int, vocab_start: int, vocab_size: Optional[int]) -> int:
    """How many of a rank's ``vocab_local`` logits, starting at ``vocab_start``, are real tokens (the rest
    is padding): all of them before the padding, none on a rank that holds only padding."""
    if vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, vocab_size - vocab_start))


def mask_vocab_padding(logits: torch.Tensor, vocab_start: int, vocab_size: Optional[int]) -> torch.Tensor:
    """Set the padded entries of this rank's logits ``[..., V/tp]`` to -inf, in place (no copy; under
    autograd they get no gradient), so that any softmax, max or argmax over them ignores the padding."""
    real = local_real_vocab(logits.shape[-1], vocab_start, vocab_size)
    if real < logits.shape[-1]:
        logits[..., real:] = float("-inf")
    return logits


@torch.no_grad()
def gather_real_vocab(logits: torch.Tensor, group: Optional[dist.ProcessGroup], vocab_size: int) -> torch.Tensor:
    """Every TP rank's logits ``[..., V_padded/tp]`` (rank r's slice starts at ``r x V_padded/tp``) as one
    contiguous ``[..., vocab_size]`` tensor on every rank: the padding is cut off while concatenating, so
    nothing vocabulary-sized is built beyond the gathered pieces and the result. Collective over ``group``."""
    vocab_local = logits.shape[-1]
    if group is None or dist.get_world_size(group) == 1:
        return logits[..., :vocab_size].contiguous() if vocab_size < vocab_local else logits
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    real = [local_real_vocab(vocab_local, r * vocab_local, vocab_size) for r in range(len(pieces))]
    return torch.cat([piece[..., :n] for piece, n in zip(pieces, real) if n > 0], dim=-1)
