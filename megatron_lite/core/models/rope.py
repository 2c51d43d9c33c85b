"""Rotary position embedding (non-interleaved halves, as in Megatron and Llama)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; applied to the first ``rotary_percent`` of each head."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, base: int = 10000):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        dim -= dim % 2
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [s] or per sample [b, s] -> (cos, sin), each [s, 1 or b, 1, dim] to
        broadcast over activations [s, b, heads, dim]."""
        freqs = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # [(b,) s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :] if emb.ndim == 2 else emb.transpose(0, 1)[:, :, None, :]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` [s, b, heads, d]; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    rot = rot * cos.to(x.dtype) + _rotate_half(rot) * sin.to(x.dtype)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
