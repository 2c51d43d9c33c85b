"""GRPOConfig: how GRPOModule samples, scores and updates (DESIGN §3 "GRPO")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


def _number(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
        or value > high
        or (low_open and value == low)
    ):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(
            f"{name} must be a finite number {bound}{'' if high == math.inf else f' and <= {high}'}, got {value!r}"
        )


def _integer(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass
class GRPOConfig:
    """Rollout, advantage and loss settings of :class:`~megatron_lite.rl.GRPOModule`."""

    group_size: int = 8
    """G: responses sampled per prompt (>= 2: advantages compare the samples of one prompt)."""
    max_new_tokens: int = 16
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0: the group needs different samples)."""
    top_k: int = 0
    """Sample among the top_k tokens only (0: all)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: all)."""
    stop_ids: Optional[list[int]] = None
    """Token ids that end a response (None: the tokenizer's EOD)."""
    rollout_seed: int = 0
    """Seed of the rollouts' sampling; rollout n of a run uses a seed derived from it and n (resumes exactly)."""
    updates_per_batch: int = 1
    """μ: optimizer steps (engine train steps) over each rollout batch; old log-probs are those before the first."""
    beta: float = 0.0
    """Weight of the k3 KL to the frozen reference model (0: no reference model is built)."""
    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + clip_eps_high (DAPO's clip-higher uses e.g. 0.28)."""
    entropy_coef: float = 0.0
    """c_H: weight of the entropy bonus (the loss subtracts c_H x entropy per token)."""
    scale_advantages: bool = True
    """Divide advantages by the group's std + 1e-4 (False: Dr.GRPO's r - mean)."""
    per_sequence_loss: bool = False
    """Average each response over its tokens, then over responses (False: one mean over every response token
    of the global batch, across DP ranks)."""
    filter_zero_variance: bool = True
    """Dynamic sampling: leave groups whose rewards are all equal out of the loss (no gradient, not counted)."""
    is_correction_cap: Optional[float] = 2.0
    """Truncated importance sampling: weight tokens by min(exp(log p_trainer - log p_sampler), cap); None: off."""
    eval_samples: int = 4
    """k of the pass@k reported on the validation prompts (sampled at ``temperature``; a seeded fixed draw)."""
    success_threshold: float = 1.0
    """A response whose reward reaches this counts as solved for pass@k."""

    def __post_init__(self) -> None:
        if isinstance(self.group_size, int) and not isinstance(self.group_size, bool) and self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (GRPO's advantages compare several samples of one prompt), "
                f"got {self.group_size}; set group_size=8 for instance"
            )
        _integer("group_size", self.group_size, 2)
        _integer("max_new_tokens", self.max_new_tokens, 1)
        _number("temperature", self.temperature, 0.0, low_open=True)
        _integer("top_k", self.top_k, 0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("rollout_seed", self.rollout_seed, 0)
        _integer("updates_per_batch", self.updates_per_batch, 1)
        _number("beta", self.beta, 0.0)
        _number("clip_eps_low", self.clip_eps_low, 0.0, 1.0)
        _number("clip_eps_high", self.clip_eps_high, 0.0)
        _number("entropy_coef", self.entropy_coef, 0.0)
        if self.is_correction_cap is not None:
            _number("is_correction_cap", self.is_correction_cap, 1.0)
        _integer("eval_samples", self.eval_samples, 1)
        _number("success_threshold", self.success_threshold, -math.inf)
        if self.stop_ids is not None:
            if not isinstance(self.stop_ids, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.stop_ids
            ):
                raise ValueError(f"stop_ids must be a list of token ids >= 0, got {self.stop_ids!r}")
            self.stop_ids = list(self.stop_ids)
