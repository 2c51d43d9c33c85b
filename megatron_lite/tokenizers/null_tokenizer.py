"""The null tokenizer: the text *is* the ids ("1 2 3"), for tests and synthetic benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_lite.tokenizers.base import Tokenizer


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated ids; ``eod`` is the last id, ``vocab_size - 1``.

    Note: Megatron-LM's ``NullTokenizer(n)`` has ``n + 1`` ids (``eod = n`` is appended); here
    ``vocab_size`` is the total number of ids, so ``NullTokenizer(n + 1)`` matches Megatron's ``NullTokenizer(n)``.
    """

    def __init__(self, vocab_size: int) -> None:
        """``vocab_size`` >= 1 ids, ``0 .. vocab_size-1``."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(
                f"NullTokenizer needs an int vocab_size >= 1 (ids 0..vocab_size-1, the last is EOD), got {vocab_size!r}"
            )
        self._vocab_size = vocab_size

    def _check(self, ids: list[int]) -> list[int]:
        """``ids`` if all are in range, else ValueError naming the first bad one."""
        for token_id in ids:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside [0, {self._vocab_size}); raise vocab_size or fix the ids"
                )
        return ids

    def tokenize(self, text: str) -> list[int]:
        """``"1 2 3"`` -> ``[1, 2, 3]``; ValueError for a non-integer or out-of-range id."""
        ids = []
        for piece in text.split():
            try:
                ids.append(int(piece))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer reads whitespace-separated integer ids, got {piece!r} in {text[:80]!r}"
                ) from None
        return self._check(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """``[1, 2, 3]`` -> ``"1 2 3"``; ValueError for an out-of-range id."""
        return " ".join(str(i) for i in self._check([int(i) for i in ids]))

    @property
    def vocab_size(self) -> int:
        """The number of ids."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The last id, ``vocab_size - 1``."""
        return self._vocab_size - 1

    @property
    def eos(self) -> int:
        """Same as ``eod``."""
        return self._vocab_size - 1
