"""A URL is never taken for a local path (issue 28): every entry point that takes a path refuses ``s3://...`` where
object storage is not supported yet (corpora, tokenizer files) and every other scheme everywhere, in one line naming
the option, the URL and the fix, before anything is read, written or spawned. ``--output-prefix s3://data/shk`` once
wrote a local folder ``s3:`` in the working directory."""

from __future__ import annotations

import json

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.callbacks import Distill, TrainDraftHead
from megatron_lite.cli import main as cli
from megatron_lite.data import MockGPTDataModule, PretrainDataModule, TextCorpusDataModule
from megatron_lite.data.preference import PreferenceDataModule
from megatron_lite.data.preprocess import preprocess
from megatron_lite.data.rl_prompts import RLPromptDataModule
from megatron_lite.data.sft import SFTDataModule
from megatron_lite.tokenizers import build_tokenizer

URL = "s3://data/shk"
# Checkpoints and indexed datasets may be at s3:// URLs (tests/integration/test_object_storage_*.py); other schemes are
# refused there.
OTHER = "gs://data/shk"
OTHER_FIX = "is a URL of an unsupported scheme; only s3:// object storage is supported"
FIX = "is a URL; object storage is not supported yet: copy the data to a local or network file system path"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory, where a URL taken for a relative path would have created ``s3:``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": "1 2 3"}) + "\n")
    yield tmp_path
    assert not (tmp_path / "s3:").exists(), "a URL was taken for a local path"


@pytest.mark.parametrize(
    "option, argv",
    [
        (
            "--input",
            [
                "preprocess",
                "--input",
                OTHER,
                "--output-prefix",
                "out/x",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "100",
            ],
        ),
        (
            "--tokenizer-model",
            [
                "preprocess",
                "--input",
                "corpus.jsonl",
                "--output-prefix",
                "out/x",
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                OTHER,
            ],
        ),
        ("--output-prefix", ["preprocess", "merge", "--input", "corpus", "--output-prefix", OTHER]),
        (
            "--output-prefix",
            [
                "preprocess",
                "--input",
                "corpus.jsonl",
                "--output-prefix",
                OTHER,
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "100",
            ],
        ),
        # checkpoints, HF directories, exports, corpora and tokenizer files may be at s3:// URLs
        # (test_object_storage_models.py, test_object_storage_data.py), not at other schemes
        ("--input", ["convert", "--from", "hf", "--input", OTHER, "--output", "out"]),
        ("--output", ["convert", "--to", "hf", "--input", "ckpt", "--output", OTHER]),
        ("--ckpt", ["quantize", "--ckpt", OTHER, "--data", "corpus.jsonl", "--output", "out"]),
        ("--output", ["quantize", "--ckpt", "ckpt", "--data", "corpus.jsonl", "--output", OTHER]),
        ("--data", ["quantize", "--ckpt", "ckpt", "--data", OTHER, "--output", "out"]),
        ("--data", ["prune", "--ckpt", "ckpt", "--data", OTHER, "--output", "out", "--num-layers", "1"]),
        ("--output", ["prune", "--ckpt", "ckpt", "--data", "corpus.jsonl", "--output", OTHER]),
        ("--ckpt", ["generate", "--ckpt", OTHER, "--prompt", "hi"]),
        ("--vocab-file", ["generate", "--ckpt", "ckpt", "--prompt", "hi", "--vocab-file", OTHER]),
        ("--tokenizer", ["convert", "--to", "hf", "--input", "ckpt", "--output", "out", "--tokenizer", OTHER]),
        ("path", ["checkpoint", "inspect", OTHER]),
    ],
)
def test_the_cli_refuses_a_url_by_option(workdir, capsys, option, argv):  # noqa: ARG001 (the fixture checks)
    with pytest.raises(SystemExit) as done:
        cli(argv)
    assert done.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    url, fix = (URL, FIX) if URL in argv else (OTHER, OTHER_FIX)
    assert f"argument {option}: {url!r} {fix}" in error


def _refused(what: str):
    return pytest.raises(ValueError, match=f"^{what} '{URL}' is a URL; object storage is not supported yet")


def test_the_library_refuses_a_url_for_data_and_tokenizers(workdir):
    corpus = str(workdir / "corpus.jsonl")
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    # indexed datasets (preprocess's output, PretrainDataModule's paths) may be at s3:// URLs, not at other schemes
    with pytest.raises(ValueError, match=f"^--output-prefix '{OTHER}' {OTHER_FIX}"):
        preprocess([corpus], OTHER, tokenizer)
    with pytest.raises(ValueError, match=f"^data path '{OTHER}' {OTHER_FIX}"):
        PretrainDataModule(["0.5", OTHER, "0.5", "local"], seq_length=8, micro_batch_size=1, global_batch_size=1)
    # JSONL corpora and tokenizer files may be at s3:// URLs too (tests/integration/test_object_storage_data.py)
    with pytest.raises(ValueError, match=f"^path '{OTHER}' {OTHER_FIX}"):
        TextCorpusDataModule(OTHER)
    with pytest.raises(ValueError, match=f"^data.path '{OTHER}' {OTHER_FIX}"):
        SFTDataModule(OTHER, tokenizer)
    with pytest.raises(ValueError, match=f"^data.path '{OTHER}' {OTHER_FIX}"):
        PreferenceDataModule([corpus, OTHER], tokenizer)
    with pytest.raises(ValueError, match=f"^path '{OTHER}' {OTHER_FIX}"):
        RLPromptDataModule(tokenizer, path=OTHER)
    with pytest.raises(ValueError, match=f"^tokenizer_model '{OTHER}' {OTHER_FIX}"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=OTHER)
    with pytest.raises(ValueError, match=f"^train_corpus '{OTHER}' {OTHER_FIX}"):
        build_tokenizer("SentencePieceTokenizer", train_corpus=OTHER, vocab_size=300, output_prefix="spm")
    with pytest.raises(ValueError, match=f"^output_prefix '{OTHER}' {OTHER_FIX}"):
        build_tokenizer("SentencePieceTokenizer", train_corpus=corpus, vocab_size=300, output_prefix=OTHER)
    with _refused("cache_dir"):  # a cache is local by nature, whatever the data's location
        TextCorpusDataModule(corpus, cache_dir=URL)


def _other_scheme(what: str):
    return pytest.raises(ValueError, match=f"^{what} '{OTHER}' {OTHER_FIX}")


def test_the_library_refuses_a_checkpoint_url_of_another_scheme(workdir):
    # s3:// is taken there (tests/integration/test_object_storage_models.py)
    with _other_scheme("GPTModule.from_pretrained path"):
        ml.GPTModule.from_pretrained(OTHER)
    with _other_scheme("adapter"):
        ml.GPTModule.from_pretrained("ckpt", adapter=OTHER)
    with _other_scheme("base"):
        ml.GPTModule.from_pretrained("ckpt", base=OTHER)
    with _other_scheme(r"Distill\(teacher=...\)"):
        Distill(teacher=OTHER)
    with _other_scheme(r"TrainDraftHead\(save_path=...\)"):
        TrainDraftHead(save_path=OTHER)
    with _other_scheme(r"TrainDraftHead\(base=...\)"):
        TrainDraftHead(base=OTHER)


def _fit(**trainer_options) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=False),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )


def _module_and_data():
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    return ml.GPTModule(config), MockGPTDataModule(seq_length=16, micro_batch_size=1, global_batch_size=2)


def test_fit_refuses_a_checkpoint_url_of_another_scheme_before_any_rank_starts(workdir):
    with pytest.raises(ValueError, match=f"^ckpt_path '{OTHER}' {OTHER_FIX}"):
        _fit(enable_checkpointing=False).fit(*_module_and_data(), ckpt_path=OTHER)
    # ModelCheckpoint without a dirpath saves under default_root_dir/checkpoints: a URL there is refused too
    with pytest.raises(ValueError, match=f"^ModelCheckpoint's directory '{OTHER}/checkpoints' {OTHER_FIX}"):
        _fit(default_root_dir=OTHER).fit(*_module_and_data())
