"""SentencePiece tokenizer: training on real Shakespeare text, exact round trips, the shared Llama model."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest

from megatron_lite.data import bundled_corpus
from megatron_lite.tokenizers import SentencePieceTokenizer, Tokenizer, train_sentencepiece

# shared/ sits beside the checkout (here and in CI)
LLAMA_MODEL = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "llama-sp" / "tokenizer.model"

# whitespace runs, leading indentation, tabs, blank lines, characters Shakespeare never used
TRICKY = "  To be, or not to be:\tthat is the question.\n\n\n   Whether 'tis nobler  é 日本 🙂 ~`|\n"


def _works(n: int) -> dict[str, str]:
    """The first ``n`` works of the bundled corpus, by id."""
    works = {}
    with gzip.open(bundled_corpus("shakespeare"), "rt", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            works[obj["id"]] = obj["text"]
            if len(works) == n:
                break
    return works


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[SentencePieceTokenizer, dict[str, str], Path]:
    """A 1000-piece BPE model trained on three plays."""
    works = _works(3)
    out = tmp_path_factory.mktemp("spm")
    path = train_sentencepiece(works.values(), str(out / "shakespeare"), 1000)
    return SentencePieceTokenizer(path), works, out


def test_trained_model_files_and_special_ids(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, _, out = trained
    assert isinstance(tok, Tokenizer)
    # only the final files remain: training happened in a temporary directory
    assert sorted(os.listdir(out)) == ["shakespeare.model", "shakespeare.vocab"]
    assert tok.vocab_size == 1000
    assert (tok.unk, tok.bos, tok.eos, tok.pad) == (0, 1, 2, None)
    assert tok.eod == tok.eos


def test_round_trip_is_exact_on_real_text(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, works, _ = trained
    for text in works.values():
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # a text the model never saw, with characters only byte fallback can express
    assert tok.detokenize(tok.tokenize(TRICKY)) == TRICKY
    assert tok.tokenize_batch([TRICKY, "Romeo"]) == [tok.tokenize(TRICKY), tok.tokenize("Romeo")]
    # BPE learnt something: far fewer tokens than characters
    hamlet_like = next(iter(works.values()))
    assert len(tok.tokenize(hamlet_like)) < len(hamlet_like) / 2


def test_pickle_keeps_the_model(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, _, _ = trained
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(TRICKY) == tok.tokenize(TRICKY)
    assert clone.model_path == tok.model_path


def test_training_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_sentencepiece(["some text"], str(tmp_path / "a"), 100)
    with pytest.raises(ValueError, match="lower vocab_size or use more text"):
        train_sentencepiece(["a tiny corpus"], str(tmp_path / "b"), 5000)
    with pytest.raises(ValueError, match="non-empty corpus"):
        train_sentencepiece(["", "\n\n"], str(tmp_path / "c"), 300)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    assert os.listdir(tmp_path) == []  # failed runs leave no temporary directories behind


@pytest.mark.skipif(not LLAMA_MODEL.is_file(), reason=f"shared Llama SentencePiece model {LLAMA_MODEL} is absent")
def test_shared_llama_model() -> None:
    tok = SentencePieceTokenizer(str(LLAMA_MODEL))
    assert tok.vocab_size == 32000
    assert (tok.bos, tok.eos, tok.eod, tok.pad) == (1, 2, 2, None)
    text = next(iter(_works(1).values()))[:5000]
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(tok.tokenize(TRICKY)) == TRICKY
    assert tok.detokenize([tok.bos, *tok.tokenize("Hello"), tok.eos]) == "Hello"
