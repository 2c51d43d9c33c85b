"""Tokenizers behind one small interface (``Tokenizer``); SentencePiece today."""

from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_sentencepiece

__all__ = ["SentencePieceTokenizer", "Tokenizer", "train_sentencepiece"]
