"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

Randomness comes from one generator per prompt, seeded from ``(seed, prompt id)``: a prompt's
sampled tokens then depend on the seed and on the prompt alone, not on which other prompts share
its batch, how a data-parallel run splits the prompts, or the model's layout (the logits are the
same full-vocabulary logits at any TP/PP size, up to float rounding).

Sampling uses the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` is distributed as
``Categorical(p)``. It needs no cumulative sum over the vocabulary and no host sync, and filtered
tokens (``p_i = 0``) can never win.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the model's distribution."""

    temperature: float = 0.0
    """0 takes the most likely token (greedy); > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only; 0 means no limit."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to top_p (nucleus); 1.0 means no limit."""
    seed: Optional[int] = None
    """Seed of the per-prompt generators (same seed and prompts: same tokens); None draws a fresh one per call."""

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 keeps every token), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax (no randomness; top_k and top_p cannot change it)."""
        return self.temperature == 0.0


def _mix(seed: int, row: int) -> int:
    """A well-spread 63-bit seed for prompt ``row`` (splitmix64 of the pair), so neighbouring prompts
    get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The tokens sampling may pick and their tempered scores: ``(scores [b, n], ids [b, n] or None)``.

    With ``top_k`` only the k best are kept (``torch.topk``: no sort of the whole vocabulary); ``top_p``
    then keeps the smallest prefix of them (sorted, most likely first) whose probability reaches it; the
    others get -inf. ``ids`` is None when every token of the vocabulary is a candidate in its own column."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    ids: Optional[torch.Tensor] = None
    if 0 < params.top_k < vocab:
        scores, ids = torch.topk(scores, params.top_k, dim=-1)  # sorted, most likely first
    elif params.top_p < 1.0:
        scores, ids = scores.sort(dim=-1, descending=True)
    if params.top_p < 1.0:
        probs = scores.softmax(dim=-1)
        # A token goes when the ones before it already reach top_p (the most likely one always stays).
        scores = scores.masked_fill((probs.cumsum(dim=-1) - probs) >= params.top_p, float("-inf"))
    return scores, ids


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` [b, V] divided by the temperature, with the tokens outside top-k / top-p at -inf."""
    scores, ids = candidates(logits, params)
    if ids is None:
        return scores
    return torch.full_like(logits, float("-inf"), dtype=scores.dtype).scatter(-1, ids, scores)


class TokenSampler:
    """Picks the next token of every row; one generator per row (see the module docstring)."""

    def __init__(self, params: SamplingParams, row_ids: Sequence[int], device: torch.device):
        self.params = params
        self.generators: list[torch.Generator] = []
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generators = [torch.Generator(device).manual_seed(_mix(seed, int(r))) for r in row_ids]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row [b] (int64) from full-vocabulary logits [b, V]."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        scores, ids = candidates(logits, self.params)
        probs = scores.softmax(dim=-1)
        n = probs.shape[-1]
        noise = torch.stack([torch.empty(n, device=probs.device).exponential_(generator=g) for g in self.generators])
        # Exp(1) can return exactly 0 (p / 0 = inf, or nan for a filtered token): keep it positive.
        choice = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        return choice if ids is None else ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) [b] under the model's own distribution: log_softmax of the raw full-vocabulary logits
    [b, V] (temperature 1, nothing filtered), whatever the sampling settings — what RL's importance
    ratios against a teacher-forced forward need."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
