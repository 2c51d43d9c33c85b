"""The calibration windows ``megatron-lite quantize`` and ``prune`` both read (``megatron_lite/data/calibration.py``):
the same windows from a JSONL corpus and from its preprocessed indexed dataset, cut as training cuts them (inputs
and shifted labels overlapping by one token), and bad data named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_lite.data.calibration import calibration_batches
from megatron_lite.data.preprocess import preprocess
from megatron_lite.tokenizers import NullTokenizer

TOKENIZER = NullTokenizer(100)  # text is the ids; eod = 99
DOCS = [" ".join(str(i) for i in range(start, start + 7)) for start in range(1, 60, 7)]


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    return path


def test_jsonl_and_indexed_dataset_give_the_same_windows(corpus: Path, tmp_path: Path) -> None:
    stream = [t for doc in DOCS for t in [*TOKENIZER.tokenize(doc), TOKENIZER.eod]]
    batches = calibration_batches(str(corpus), TOKENIZER, seq_length=5, batch_size=2, count=3)
    assert [b["tokens"].shape for b in batches] == [torch.Size([2, 6])] * 3
    for i, batch in enumerate(batches):
        for r in range(2):
            start = (i * 2 + r) * 5
            assert batch["tokens"][r].tolist() == stream[start : start + 6]
    prefix = preprocess([str(corpus)], str(tmp_path / "ds"), TOKENIZER, append_eod=True).output_prefixes["text"]
    indexed = calibration_batches(prefix, TOKENIZER, seq_length=5, batch_size=2, count=3)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(batches, indexed))


def test_bad_data_is_named(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"holds 72 tokens: 14 windows of 5 \+ 1 tokens, fewer than the 16 .* lower "
        r"--calib-batches",
    ):
        calibration_batches(str(corpus), TOKENIZER, seq_length=5, batch_size=4, count=4)
    with pytest.raises(ValueError, match=r"token id 99, outside the model's vocabulary \(64\)"):
        calibration_batches(str(corpus), TOKENIZER, seq_length=5, batch_size=2, count=1, vocab_size=64)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        calibration_batches(str(empty), TOKENIZER, seq_length=5, batch_size=1, count=1)
    with pytest.raises(FileNotFoundError, match="not an indexed dataset prefix"):
        calibration_batches(str(tmp_path / "nowhere"), TOKENIZER, seq_length=5, batch_size=1, count=1)
