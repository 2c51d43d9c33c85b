"""The tokenizer interface every backend (SentencePiece, GPT-2 BPE, HF, tiktoken) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Text <-> token ids. Special ids a model does not define are ``None``."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids; every id is in ``[0, vocab_size)``."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id appended after each document when building pretraining data."""

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None if the vocabulary has none."""
        return None

    @property
    def eos(self) -> int | None:
        """End-of-sequence id, or None if the vocabulary has none."""
        return None

    @property
    def pad(self) -> int | None:
        """Padding id, or None if the vocabulary has none."""
        return None
