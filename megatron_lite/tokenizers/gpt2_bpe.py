"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, run by the Hugging Face ``tokenizers`` library."""

from __future__ import annotations

import os

from megatron_lite.tokenizers._hf_backed import HFBackedTokenizer
from megatron_lite.tokenizers.base import require_file
from megatron_lite.utils.optional import require

GPT2_EOD_TOKEN = "<|endoftext|>"
"""GPT-2's only special token: it ends documents (and sequences)."""


class GPT2BPETokenizer(HFBackedTokenizer):
    """GPT-2 BPE (Megatron's ``GPT2BPETokenizer``): ids equal tiktoken's ``gpt2``; ``eod = eos = <|endoftext|>``.

    Text is always encoded as plain text, so a literal ``"<|endoftext|>"`` inside a document becomes
    ordinary pieces, never the EOD id (as Megatron and tiktoken's ``encode_ordinary`` do): only the data
    pipeline decides where documents end; decoding turns the EOD id back into ``"<|endoftext|>"``. GPT-2 has
    no BOS, PAD or UNK (byte-level BPE covers every byte).
    """

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]) -> None:
        """Load the two files; FileNotFoundError / ValueError name the file at fault and the fix."""
        hf = require("tokenizers", "GPT2BPETokenizer")  # the data extra, not the base install
        self.vocab_file = require_file(vocab_file, "GPT-2 vocab_file", "pass the path of GPT-2's vocab.json")
        """Path of ``vocab.json``."""
        self.merge_file = require_file(merge_file, "GPT-2 merge_file", "pass the path of GPT-2's merges.txt")
        """Path of ``merges.txt``."""
        try:
            model = hf.models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise ValueError(
                f"cannot read GPT-2 BPE files vocab_file={self.vocab_file} merge_file={self.merge_file} ({err}); "
                f"vocab_file must be the JSON token->id map (vocab.json) and merge_file the merges list "
                f"(merges.txt): check they are not swapped"
            ) from err
        tok = hf.Tokenizer(model)
        # GPT-2 never adds a leading space; with it "Hello" would encode as " Hello" and round trips break
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = hf.decoders.ByteLevel()
        eod = tok.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise ValueError(
                f"vocab_file {self.vocab_file} has no {GPT2_EOD_TOKEN!r} token; GPT2BPETokenizer needs "
                f"GPT-2's vocab.json (for another BPE vocabulary use HuggingFaceTokenizer)"
            )
        self._tok = tok
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        """50257 for GPT-2."""
        return int(self._tok.get_vocab_size())

    @property
    def eod(self) -> int:
        """The ``<|endoftext|>`` id (50256 for GPT-2)."""
        return self._eod

    @property
    def eos(self) -> int:
        """Same as ``eod``: GPT-2 ends every sequence with ``<|endoftext|>``."""
        return self._eod

    @property
    def eos_token(self) -> str:
        """``"<|endoftext|>"``."""
        return GPT2_EOD_TOKEN
