"""Rewards for GRPO as plain Python: functions of one :class:`Sample` that return a number.

Write your own as ``def my_reward(sample: Sample) -> float``. The built-ins here check answers (exact match, a
numeric checker) and formats (a regex); :class:`WeightedRewards` adds several with weights and
:class:`RewardModelReward` scores with a trained :class:`~megatron_lite.rl.RewardModelModule` checkpoint. Every
rank of a model replica scores the same samples (they generated the same tokens), so rewards need no
communication; a function that raises or returns a non-number stops the run with an error naming the function
and the sample.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

import torch

RewardFn = Callable[["Sample"], float]

_NUMBER = re.compile(r"[-+]?\d+/\d+|[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")  # a fraction first


@dataclass
class Sample:
    """One generated response, what a reward function sees."""

    prompt: str
    """The prompt's text."""
    completion: str
    """The response's text (without the stop token that ended it)."""
    answer: Optional[str] = None
    """The reference answer of the prompt's data row, if it has one."""
    prompt_ids: list[int] = field(default_factory=list)
    """The prompt's token ids."""
    completion_ids: list[int] = field(default_factory=list)
    """The response's token ids (with the stop token, when it ended on one)."""
    stopped: bool = False
    """True when the response ended on a stop id, False when it ran to max_new_tokens."""


def exact_match(sample: Sample) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer (stripped), else 0.0."""
    if sample.answer is None:
        raise ValueError("exact_match needs an answer: give every prompt row an 'answer' field")
    return float(sample.completion.strip() == sample.answer.strip())


class RegexReward:
    """``reward`` when the completion matches ``pattern`` (``re.fullmatch`` with ``full=True``, else
    ``re.search``), else 0.0: a format check such as ``r"\\d+"`` (digits only)."""

    def __init__(self, pattern: str, reward: float = 1.0, full: bool = True) -> None:
        self.pattern, self.reward, self.full = re.compile(pattern), float(reward), full
        self.__name__ = f"RegexReward({pattern!r})"

    def __call__(self, sample: Sample) -> float:
        text = sample.completion.strip()
        found = self.pattern.fullmatch(text) if self.full else self.pattern.search(text)
        return self.reward if found else 0.0


def _parse_number(text: str) -> Optional[Fraction]:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_answer(sample: Sample, tolerance: float = 1e-6) -> float:
    """1.0 when the LAST number in the completion (integers, decimals, ``a/b``, exponents) equals the answer's
    number within ``tolerance`` (relative to the answer, absolute near 0), else 0.0."""
    if sample.answer is None:
        raise ValueError("numeric_answer needs an answer: give every prompt row an 'answer' field")
    expected = _parse_number(sample.answer.strip())
    if expected is None:
        raise ValueError(f"numeric_answer: the answer {sample.answer!r} is not a number")
    found = _NUMBER.findall(sample.completion)
    got = _parse_number(found[-1]) if found else None
    if got is None:
        return 0.0
    return float(abs(float(got) - float(expected)) <= tolerance * max(1.0, abs(float(expected))))


def reward_name(fn: Any) -> str:
    """How an error names a reward function."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def call_reward(fn: RewardFn, sample: Sample) -> float:
    """``fn(sample)`` as a finite float; any exception, or a result that is not a finite real number, becomes one
    ValueError naming the function and the sample."""
    where = f"reward function {reward_name(fn)} on sample (prompt={sample.prompt!r}, completion={sample.completion!r})"
    try:
        value = fn(sample)
    except Exception as error:  # the user's code: say where it failed, keep its cause
        raise ValueError(f"{where} raised {type(error).__name__}: {error}") from error
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{where} returned {value!r}; a reward function must return a finite number (int or float)")
    return float(value)


class WeightedRewards:
    """The sum of several reward functions times their weights, e.g. ``WeightedRewards({exact_match: 1.0,
    RegexReward(r"\\d+"): 0.1})``."""

    def __init__(self, weights: dict[RewardFn, float]) -> None:
        if not weights:
            raise ValueError("WeightedRewards needs at least one {reward_function: weight}")
        for fn, weight in weights.items():
            if not callable(fn):
                raise TypeError(f"{fn!r} is not callable; a reward is a function of a Sample")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"the weight of {reward_name(fn)} must be a finite number, got {weight!r}")
        self.weights = dict(weights)
        self.__name__ = "WeightedRewards"

    def __call__(self, sample: Sample) -> float:
        return sum(weight * call_reward(fn, sample) for fn, weight in self.weights.items())


class RewardModelReward:
    """Scores with a trained reward model: ``RewardModelReward("runs/rm/last.ckpt")`` loads a
    :class:`~megatron_lite.rl.RewardModelModule` checkpoint once, for one process, and returns its scalar
    reward of prompt + completion tokens (every rank scores its samples with its own copy)."""

    def __init__(self, path: str, scale: float = 1.0) -> None:
        from megatron_lite.rl.reward_model import RewardModelModule  # the module pulls in Lightning

        self.module = RewardModelModule.from_pretrained(path)
        self.scale = float(scale)
        self.__name__ = f"RewardModelReward({path!r})"

    @torch.no_grad()
    def __call__(self, sample: Sample) -> float:
        from megatron_lite.core.models.reward import chunk_rewards

        ids = (list(sample.prompt_ids) + list(sample.completion_ids))[: self.module.config.seq_length]
        model = self.module.model
        model.eval()
        tokens = torch.tensor([ids], dtype=torch.int64)
        return self.scale * float(chunk_rewards(model, tokens, torch.tensor([len(ids)]), None)[0])


def score(samples: Sequence[Sample], reward_fn: RewardFn) -> torch.Tensor:
    """Rewards [n] (float64) of ``samples`` under ``reward_fn`` (see :func:`call_reward` for errors)."""
    return torch.tensor([call_reward(reward_fn, s) for s in samples], dtype=torch.float64)
