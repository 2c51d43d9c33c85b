"""tiktoken BPE with Megatron's ``TikTokenizer`` id layout: special tokens first, BPE ranks after them.

Id layout (as Megatron-LM's ``TikTokenizer``): ids ``0 .. num_special_tokens-1`` are special tokens —
the given ``special_tokens`` (default ``<unk>``, ``<s>``, ``</s>``, so unk=0, bos=1, eos=eod=2) padded
with ``<SPECIAL_i>`` fillers — and BPE rank ``r`` of the file becomes id ``r + num_special_tokens``.
``vocab_size`` (optional) keeps only the ranks below ``vocab_size - num_special_tokens`` (Megatron's
truncation); by default every rank is kept. Text is encoded with ``encode_ordinary``: special-token
strings inside documents are plain text.

Two file formats are read: tiktoken's rank file (``<base64 token> <rank>`` per line, what
``tiktoken.load.load_tiktoken_bpe`` reads; we parse it ourselves because that function caches files
by path in a temp directory and would serve a stale copy after the file changes), and Megatron/NeMo's
JSON list of ``{"rank", "token_bytes", "token_str"}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence

from megatron_lite.tokenizers.base import Tokenizer, require_file
from megatron_lite.utils.optional import require

PATTERNS = {
    # Megatron-LM's --tiktoken-pattern v1 and v2
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # tiktoken's r50k/gpt2 split, for rank files converted from GPT-2 style vocabularies
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
}
"""Named pre-tokenization regexes; any other ``pattern`` string is used as a regex itself."""

REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""Megatron's TikTokenizer requires these among the special tokens."""


def load_ranks(path: str) -> dict[bytes, int]:
    """Token bytes -> rank from a tiktoken rank file or a Megatron/NeMo JSON vocabulary; ValueError on bad input."""
    with open(path, "rb") as f:
        data = f.read()
    ranks: dict[bytes, int] = {}
    if data.lstrip().startswith(b"["):
        try:
            entries = json.loads(data)
            for index, entry in enumerate(entries):
                if entry["rank"] != index:
                    raise ValueError(f"entry {index} has rank {entry['rank']}; ranks must be 0, 1, 2, ... in order")
                ranks[base64.b64decode(entry["token_bytes"], validate=True)] = index
        except (ValueError, KeyError, TypeError, binascii.Error) as err:
            raise ValueError(
                f'{path} is not a Megatron tiktoken JSON vocabulary (a list of {{"rank", '
                f'"token_bytes", "token_str"}}): {err}; fix the file'
            ) from err
    else:
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as err:
                raise ValueError(
                    f"{path}:{number}: {line[:80]!r} is not '<base64 token> <rank>'; pass a tiktoken "
                    f"rank file (e.g. cl100k_base.tiktoken) or a Megatron JSON vocabulary"
                ) from err
    _check_ranks(ranks, path)
    return ranks


def _check_ranks(ranks: dict[bytes, int], path: str) -> None:
    """tiktoken needs ranks 0..n-1 without holes and every single byte (else it panics on unseen bytes)."""
    if not ranks:
        raise ValueError(f"{path} holds no tokens; pass a tiktoken rank file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"{path}: ranks must be 0..{len(ranks) - 1}, each once (duplicates or gaps found); fix the rank file"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} single-byte tokens (e.g. byte {missing[0]}); byte-level BPE "
            f"needs all 256; pass a complete byte-level rank file"
        )


class TikTokenizer(Tokenizer):
    """A tiktoken encoding from a local rank file, with Megatron's special-token-first id layout (module doc)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        pattern: str = "v2",
        special_tokens: Sequence[str] | None = None,
        num_special_tokens: int = 1000,
        vocab_size: int | None = None,
    ) -> None:
        """Load ``path``; ``pattern`` is "v1", "v2", "gpt2" or a regex; errors name the fix."""
        tiktoken = require("tiktoken", "TikTokenizer")  # the data extra, not the base install
        self.path = require_file(
            path,
            "tiktoken rank file",
            "pass the path of a local .tiktoken rank file (megatron-lite never downloads one)",
        )
        """The rank file."""
        specials = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(specials)) != len(specials):
            raise ValueError(f"special_tokens must be unique, got {specials}")
        missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in specials]
        if missing:
            raise ValueError(
                f"special_tokens must include {list(REQUIRED_SPECIAL_TOKENS)} (missing {missing}), got {specials}"
            )
        if (
            isinstance(num_special_tokens, bool)
            or not isinstance(num_special_tokens, int)
            or num_special_tokens < len(specials)
        ):
            raise ValueError(
                f"num_special_tokens={num_special_tokens!r} must be an int >= len(special_tokens) = {len(specials)}"
            )
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        self.num_special_tokens = num_special_tokens
        """Ids reserved for special tokens before the BPE ranks."""

        ranks = load_ranks(self.path)
        if vocab_size is not None:
            inner = vocab_size - num_special_tokens
            if inner < 256 or inner > len(ranks):
                raise ValueError(
                    f"vocab_size={vocab_size} leaves {inner} BPE ranks after {num_special_tokens} special tokens, "
                    f"but {self.path} has {len(ranks)} (and at least the 256 byte tokens are needed); use a "
                    f"vocab_size in [{num_special_tokens + 256}, {num_special_tokens + len(ranks)}] or None"
                )
            ranks = {token: rank for token, rank in ranks.items() if rank < inner}
        self.pattern = PATTERNS.get(pattern, pattern)
        """The pre-tokenization regex."""
        try:
            self._enc = tiktoken.Encoding(
                name=f"megatron-lite:{os.path.basename(self.path)}",
                pat_str=self.pattern,
                mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
                special_tokens={token: i for i, token in enumerate(specials)},
            )
        except ValueError as err:
            raise ValueError(
                f"pattern {pattern!r} is not a valid regex ({err}); pass 'v1', 'v2', 'gpt2' or a regex tiktoken accepts"
            ) from err
        self._specials = specials
        self._vocab_size = num_special_tokens + len(ranks)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are encoded as plain text."""
        return self._enc.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special ids decode to their names); ValueError for ids outside the vocabulary."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {self._vocab_size}) of {self.path}")
        return self._enc.decode(ids)

    @property
    def vocab_size(self) -> int:
        """``num_special_tokens`` + the number of BPE ranks kept."""
        return self._vocab_size

    @property
    def special_tokens(self) -> list[str]:
        """The special tokens in id order (``<SPECIAL_i>`` fillers included)."""
        return list(self._specials)

    @property
    def eod(self) -> int:
        """The ``</s>`` id."""
        return self._specials.index("</s>")

    @property
    def bos(self) -> int:
        """The ``<s>`` id."""
        return self._specials.index("<s>")

    @property
    def eos(self) -> int:
        """The ``</s>`` id."""
        return self._specials.index("</s>")

    @property
    def unk(self) -> int:
        """The ``<unk>`` id."""
        return self._specials.index("<unk>")

    @property
    def bos_token(self) -> str:
        """``"<s>"``."""
        return "<s>"

    @property
    def eos_token(self) -> str:
        """``"</s>"``."""
        return "</s>"
