"""Greedy decoding by full recomputation (a KV cache comes with the inference issue).

Under tensor parallelism every TP rank must call it with the same prompt: the logits are
gathered across the TP group, so every rank picks the same next token.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                    eos_id: Optional[int] = None,
                    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Append up to ``max_new_tokens`` argmax tokens to ``prompt`` [b, s]; returns [b, s + n].

    The context is cropped to the model's ``seq_length``; sequence parallelism is switched off
    for the call (arbitrary lengths) and restored afterwards. ``logits_fn`` (tokens -> full-vocabulary
    logits on every rank) replaces ``model.full_logits``: under pipeline parallelism it runs the
    stages (``GPTModule.full_logits``).
    """
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [batch, length] tensor of token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    sequence_parallel = getattr(model, "sequence_parallel", False)
    model.eval()
    if sequence_parallel:
        model.set_sequence_parallel(False)
    try:
        tokens = prompt
        context = model.config.seq_length
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            logits = (logits_fn or model.full_logits)(tokens[:, -context:])[:, -1, :]
            next_token = logits.argmax(dim=-1)
            if eos_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
                finished |= next_token == eos_id
            tokens = torch.cat([tokens, next_token.unsqueeze(1)], dim=1)
            if eos_id is not None and bool(finished.all()):
                break
        return tokens
    finally:
        if sequence_parallel:
            model.set_sequence_parallel(True)
        model.train(was_training)
