"""The tokenizer interface every backend (SentencePiece, GPT-2 BPE, HF, tiktoken, null) implements."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_lite.tokenizers.chat import render_chat_template


def require_file(path: str | os.PathLike[str], what: str, fix: str) -> str:
    """``str(path)`` if it is a file, else FileNotFoundError naming the file and the fix."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        state = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{what} {path} {state}; {fix}")
    return path


class Tokenizer(ABC):
    """Text <-> token ids. Special ids a model does not define are ``None``.

    Subclasses need no ``__init__`` call: optional state (the chat template override) is read with a
    default, so backends written before these attributes existed keep working.
    """

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

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; backends with a native batch call override this loop."""
        return [self.tokenize(text) for text in texts]

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

    @property
    def unk(self) -> int | None:
        """Unknown-token id, or None if the vocabulary has none."""
        return None

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (what a chat template's ``bos_token`` prints), or None."""
        return None

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (what a chat template's ``eos_token`` prints), or None."""
        return None

    @property
    def chat_template(self) -> str | None:
        """Jinja2 chat template: the one set on this tokenizer, else the model's own, else None."""
        override = getattr(self, "_chat_template_override", None)
        return override if override is not None else self._native_chat_template()

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Override the model's template (None restores it)."""
        if template is not None and not isinstance(template, str):
            raise TypeError(f"chat_template must be a Jinja2 string or None, got {type(template).__name__}")
        self._chat_template_override = template

    def _native_chat_template(self) -> str | None:
        """The template shipped with the model files; backends that read one override this."""
        return None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) to text, as HF's ``apply_chat_template``.

        Uses ``chat_template`` if given, else this tokenizer's template; raises ValueError when there is
        neither. The template sees ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                f"{type(self).__name__} has no chat template; pass chat_template=... (a Jinja2 string, e.g. "
                f"megatron_lite.tokenizers.DEFAULT_CHAT_TEMPLATE) or build_tokenizer(..., chat_template=...)"
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
