"""Rotary position embedding (non-interleaved halves, as in Megatron and Llama)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for a longer context than pre-training's (GPTConfig.rope_scaling())."""

    kind: str
    """'linear', 'llama3' or 'yarn'."""
    factor: float
    """Context stretch factor."""
    low_freq_factor: float = 1.0
    """'llama3': wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """'llama3': wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """'llama3' and 'yarn': pre-training's context length."""
    beta_fast: float = 32.0
    """'yarn': frequencies turning more than this many times over the original context are kept."""
    beta_slow: float = 1.0
    """'yarn': frequencies turning fewer than this many times over it are divided by the factor."""
    mscale: float = 1.0
    """'yarn': multiplier of log(factor) in the cos/sin scale (:meth:`rotary_scale`)."""
    mscale_all_dim: float = 0.0
    """'yarn': multiplier of log(factor) in the softmax scale (:meth:`softmax_scale_factor`) and the cos/sin one."""

    def rotary_scale(self) -> float:
        """What YaRN multiplies cos and sin by (so the rotated channels' part of q.k by its square); 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    def softmax_scale_factor(self) -> float:
        """What YaRN multiplies the softmax scale 1/sqrt(d) by (DeepSeek's mscale_all_dim rule); 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    # YaRN (Peng et al. 2023): channel pairs whose frequency turns more than beta_fast times over the original
    # context keep it, those turning fewer than beta_slow times are slowed by the factor, with a linear ramp over
    # the channel index between (the bounds rounded outwards, as DeepSeek, transformers and Megatron do).
    def channel(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(channel(scaling.beta_fast)), 0))
    high = float(min(math.ceil(channel(scaling.beta_slow)), dim - 1))
    if low == high:
        high += 0.001  # a ramp of width zero: a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def inverse_frequencies(dim: int, base: float, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """RoPE's ``dim / 2`` inverse frequencies ``base^(-2i/dim)`` (fp32), with ``scaling`` applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":  # the same as dividing every position by the factor
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, dim, base, scaling)
    if scaling.kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling.kind!r}; use 'linear', 'llama3' or 'yarn'")
    # Llama 3.1: a frequency whose wavelength fits many times into the original context (high frequency,
    # local position) is kept; one whose wavelength is longer than the context is slowed by the factor;
    # between the two the result is blended linearly in context / wavelength.
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    slowed = inv_freq / scaling.factor
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelength > context / scaling.low_freq_factor, slowed, inv_freq)
    between = (wavelength <= context / scaling.low_freq_factor) & (wavelength >= context / scaling.high_freq_factor)
    return torch.where(between, blended, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; applied to the first ``rotary_percent`` of each head."""

    inv_freq: torch.Tensor

    def __init__(
        self, kv_channels: int, rotary_percent: float = 1.0, base: float = 10000, scaling: Optional[RopeScaling] = None
    ):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        dim -= dim % 2
        self.dim = dim
        self.scale = scaling.rotary_scale() if scaling is not None else 1.0
        self.register_buffer("inv_freq", inverse_frequencies(dim, base, scaling), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [s] or per sample [b, s] -> (cos, sin), each [s, 1 or b, 1, dim] to
        broadcast over activations [s, b, heads, dim]."""
        freqs = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # [(b,) s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :] if emb.ndim == 2 else emb.transpose(0, 1)[:, :, None, :]
        if self.scale != 1.0:
            return emb.cos() * self.scale, emb.sin() * self.scale
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
