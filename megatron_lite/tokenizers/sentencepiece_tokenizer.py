"""SentencePiece tokenizer (Llama-style models, or one trained on a corpus with ``train_sentencepiece``)."""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.optional import require

# byte-fallback models reserve 256 byte pieces plus unk/bos/eos and the "\n" user symbol
MIN_BYTE_FALLBACK_VOCAB = 256 + 4
# lines longer than this many bytes are skipped by the trainer (SentencePiece's own default: 4192)
_MAX_SENTENCE_BYTES = 1 << 16


def _spm(purpose: str) -> ModuleType:
    """The ``sentencepiece`` module, imported on first use: it is in the ``data`` extra, not the base install."""
    return require("sentencepiece", purpose)


class SentencePieceTokenizer(Tokenizer):
    """Wraps a SentencePiece ``.model`` file. ``bos``/``eos``/``pad`` are None when the model lacks them."""

    def __init__(self, model_path: str) -> None:
        """Load ``model_path``; raises FileNotFoundError naming the path if it is missing."""
        spm = _spm("SentencePieceTokenizer")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"SentencePiece model {model_path} does not exist; pass the path of a .model file")
        self.model_path = model_path
        """Path the model was loaded from."""
        self._sp = spm.SentencePieceProcessor(model_file=model_path)

    # the processor is a C++ object; ship the model bytes so the tokenizer survives pickling (spawned ranks)
    def __getstate__(self) -> dict[str, Any]:
        """Picklable state: the path, the serialized model and any chat template set on it."""
        return {
            "model_path": self.model_path,
            "proto": self._sp.serialized_model_proto(),
            "chat_template": getattr(self, "_chat_template_override", None),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the processor from the serialized model."""
        self.model_path = state["model_path"]
        self._sp = _spm("SentencePieceTokenizer").SentencePieceProcessor(model_proto=state["proto"])
        self._chat_template_override = state.get("chat_template")

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; SentencePiece encodes a list in one native call."""
        return self._sp.encode(list(texts), out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model."""
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        """End-of-document id: the EOS id; raises ValueError if the model has no EOS piece."""
        eos = self.eos
        if eos is None:
            raise ValueError(
                f"SentencePiece model {self.model_path} has no EOS piece to mark document ends; "
                f"use a model trained with eos_id >= 0"
            )
        return eos

    @property
    def bos(self) -> int | None:
        """BOS id, or None if the model has none."""
        return _optional_id(self._sp.bos_id())

    @property
    def eos(self) -> int | None:
        """EOS id, or None if the model has none."""
        return _optional_id(self._sp.eos_id())

    @property
    def pad(self) -> int | None:
        """PAD id, or None if the model has none (SentencePiece's default, and Llama's)."""
        return _optional_id(self._sp.pad_id())

    @property
    def unk(self) -> int | None:
        """UNK id, or None if the model has none."""
        return _optional_id(self._sp.unk_id())

    @property
    def bos_token(self) -> str | None:
        """BOS piece (e.g. ``"<s>"``), or None."""
        return self._piece(self.bos)

    @property
    def eos_token(self) -> str | None:
        """EOS piece (e.g. ``"</s>"``), or None."""
        return self._piece(self.eos)

    def _piece(self, token_id: int | None) -> str | None:
        """The piece text of ``token_id`` (what chat templates print), or None."""
        return None if token_id is None else str(self._sp.id_to_piece(token_id))


def _optional_id(value: int) -> int | None:
    """SentencePiece reports a missing special piece as -1."""
    return None if value < 0 else int(value)


class _LineCounter:
    """The non-empty lines of every text (the trainer reads sentences, and whole documents are long), counting
    those longer than ``max_bytes``: SentencePiece skips them without a word."""

    def __init__(self, texts: Iterable[str], max_bytes: int) -> None:
        self.texts, self.max_bytes = texts, max_bytes
        self.lines = 0
        """Non-empty lines handed to the trainer."""
        self.too_long = 0
        """Of those, lines longer than ``max_bytes`` (UTF-8): the trainer skipped them."""
        self.longest = 0
        """Bytes of the longest line that was too long."""

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            for line in text.split("\n"):
                if not line:
                    continue
                self.lines += 1
                # a character is at most 4 UTF-8 bytes: only long lines need encoding to be measured
                if 4 * len(line) > self.max_bytes and len(size := line.encode("utf-8")) > self.max_bytes:
                    self.too_long += 1
                    self.longest = max(self.longest, len(size))
                yield line

    def advice(self) -> str:
        """What to do about the skipped lines (empty when none was skipped)."""
        if not self.too_long:
            return ""
        return (
            f"{self.too_long} of its {self.lines} lines are longer than max_sentence_length ({self.max_bytes} "
            f"bytes; the longest holds {self.longest}) and SentencePiece skips such lines: split the text into "
            f"shorter lines (the trainer reads one line at a time), or raise max_sentence_length: "
            f"train_sentencepiece(..., max_sentence_length={self.longest}) (then load its .model, e.g. as "
            f"TextCorpusDataModule's tokenizer_model)"
        )


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    input_sentence_size: int = 2_000_000,
    num_threads: int = 1,
    max_sentence_length: int = _MAX_SENTENCE_BYTES,
) -> str:
    """Train a lossless byte-fallback model on ``texts``; returns ``<model_prefix>.model``.

    The settings make ``detokenize(tokenize(t)) == t`` for any text: identity normalization, whitespace
    kept as is, bytes for unseen characters, and "\\n" as its own piece (training sees lines, so newlines
    never reach the trainer otherwise). The files appear atomically: concurrent callers never see a
    half-written model. The trainer skips lines longer than ``max_sentence_length`` bytes: a warning says how
    many it skipped, and a corpus of nothing but such lines is refused with the fix.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BYTE_FALLBACK_VOCAB:
        raise ValueError(
            f"vocab_size must be >= {MIN_BYTE_FALLBACK_VOCAB} for a byte-fallback SentencePiece model "
            f"(plus one piece per distinct character), got {vocab_size!r}; use vocab_size >= 512"
        )
    if isinstance(max_sentence_length, bool) or not isinstance(max_sentence_length, int) or max_sentence_length < 1:
        raise ValueError(f"max_sentence_length must be a positive number of bytes, got {max_sentence_length!r}")
    spm = _spm("training a SentencePiece tokenizer")
    lines = _LineCounter(texts, max_sentence_length)
    directory = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".spm-train-") as tmp:
        tmp_prefix = os.path.join(tmp, "model")
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_prefix=tmp_prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                byte_fallback=True,
                user_defined_symbols=["\n"],
                input_sentence_size=input_sentence_size,
                shuffle_input_sentence=True,
                max_sentence_length=max_sentence_length,
                num_threads=num_threads,
                minloglevel=2,
            )
        except RuntimeError as err:
            raise ValueError(_explain_training_error(str(err), vocab_size, lines)) from err
        if lines.too_long:
            warnings.warn(f"the tokenizer was trained without part of the corpus: {lines.advice()}", stacklevel=2)
        # .vocab first: a present .model is the signal that training finished
        os.replace(tmp_prefix + ".vocab", model_prefix + ".vocab")
        os.replace(tmp_prefix + ".model", model_prefix + ".model")
    return model_prefix + ".model"


def _explain_training_error(message: str, vocab_size: int, lines: _LineCounter) -> str:
    """Turn SentencePiece's trainer errors into advice."""
    if lines.too_long == lines.lines > 0:  # every line skipped: the trainer saw no text at all
        return f"no text to train the tokenizer on: {lines.advice()}"
    needed = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if needed:
        return (
            f"vocab_size {vocab_size} is too small for this corpus: it needs at least {needed.group(2)} "
            f"pieces (256 bytes + special pieces + one per character); raise vocab_size"
        )
    if "Vocabulary size too high" in message:
        return (
            f"vocab_size {vocab_size} is larger than this corpus can fill ({message.strip()}); "
            f"lower vocab_size or use more text"
        )
    if "Corpus" in message or "empty" in message.lower():
        return f"no text to train the tokenizer on ({message.strip()}); pass a non-empty corpus"
    return f"SentencePiece training failed: {message.strip()}"
