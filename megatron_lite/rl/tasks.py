"""Toy verifiable tasks for GRPO: prompts with a known answer, a character tokenizer that fits a tiny model,
and the reward that checks them. ``AdditionTask`` is "teach a small model ``a+b=``": each prompt is a sum of
two small numbers and the reward is 1 when the completion is the result."""

from __future__ import annotations

import random
from collections.abc import Sequence

from megatron_lite.rl.rewards import Sample, exact_match
from megatron_lite.tokenizers.base import Tokenizer


class CharTokenizer(Tokenizer):
    """One id per character of ``alphabet``; the last id (``len(alphabet)``) is EOD. Unknown characters raise."""

    def __init__(self, alphabet: str = "0123456789+-*= ") -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet must be non-empty characters without repeats, got {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {c: i for i, c in enumerate(alphabet)}

    def tokenize(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as error:
            raise ValueError(f"character {error.args[0]!r} is not in the alphabet {self.alphabet!r}") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if 0 <= i < len(self.alphabet))

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 1

    @property
    def eod(self) -> int:
        return len(self.alphabet)

    @property
    def eos(self) -> int:
        return len(self.alphabet)


class AdditionTask:
    """Prompts ``"a+b="`` with ``0 <= a, b <= max_operand`` (every pair, shuffled with ``seed``) and answers
    ``str(a + b)``; ``reward`` is :func:`~megatron_lite.rl.rewards.exact_match`."""

    def __init__(self, max_operand: int = 4, seed: int = 0) -> None:
        if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"max_operand must be an integer >= 1, got {max_operand!r}")
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        random.Random(seed).shuffle(pairs)
        self.rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
        self.tokenizer = CharTokenizer()
        self.max_answer_tokens = len(str(2 * max_operand))

    @staticmethod
    def reward(sample: Sample) -> float:
        """1.0 for the right sum, else 0.0."""
        return exact_match(sample)

    def split(self, held_out: int) -> tuple[list[dict], list[dict]]:
        """(training rows, ``held_out`` evaluation rows)."""
        if not 0 <= held_out < len(self.rows):
            raise ValueError(f"held_out must be in [0, {len(self.rows)}), got {held_out}")
        return self.rows[held_out:], self.rows[:held_out]
