"""Tokenizers behind one interface (``Tokenizer``) and ``build_tokenizer`` over Megatron's type names.

Backends: SentencePiece (load or train), GPT-2 BPE (``vocab.json``/``merges.txt``), any local Hugging Face
``tokenizer.json``, tiktoken rank files (Megatron's special-tokens-first layout) and the null tokenizer.
Only local files are read; nothing is ever downloaded.
"""

from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.tokenizers.build import TOKENIZER_TYPES, build_tokenizer, canonical_tokenizer_type, tokenizer_spec
from megatron_lite.tokenizers.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat_template
from megatron_lite.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron_lite.tokenizers.huggingface import HuggingFaceTokenizer
from megatron_lite.tokenizers.null_tokenizer import NullTokenizer
from megatron_lite.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece
from megatron_lite.tokenizers.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "TOKENIZER_TYPES",
    "ChatTemplateError",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "canonical_tokenizer_type",
    "render_chat_template",
    "tokenizer_spec",
    "train_sentencepiece",
]
