"""Encoding and decoding shared by the backends that run on the Hugging Face ``tokenizers`` library."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_lite.tokenizers.base import Tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer


class HFBackedTokenizer(Tokenizer):
    """A ``Tokenizer`` whose subclass's ``__init__`` sets ``self._tok`` to a ``tokenizers.Tokenizer``.

    Nothing is added around the text when encoding (no BOS/EOS, as Megatron's data pipeline expects: it
    decides where documents end), and special tokens are kept when decoding.
    """

    _tok: _HFTokenizer

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust library."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
