"""The verbs that write checkpoints (``convert``, ``quantize``, ``prune``), run in this process on real files with
a tiny model and a SentencePiece tokenizer trained into a cache folder: ``--overwrite`` never deletes an input
(nor a directory holding one, through a symbolic link too) or a directory megatron-lite did not write, and does
replace an earlier output; every writer carries the tokenizer into its output as copies of the files,
checksummed with the checkpoint, so the output generates -- and exports its tokenizer for transformers -- after
the cache is gone; bad input is one line (an existing output, a corpus without text, a ``--seq-length`` past the
model's context); ``megatron-lite checkpoint inspect CKPT | head`` ends quietly."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_lite as ml
from megatron_lite.cli import convert, prune, quantize
from megatron_lite.cli import main as cli_main
from megatron_lite.core.checkpoint.format.integrity import read_manifest, verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.data.bundled import bundled_corpus
from megatron_lite.pretrained import save_weights_checkpoint
from megatron_lite.tokenizers import build_tokenizer
from megatron_lite.tokenizers.build import TOKENIZER_KEY, tokenizer_spec

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 384, 16


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """A checkpoint of a tiny model recording a tokenizer that lives in a cache folder (as one written before
    checkpoints carried their tokenizer: the absolute path of the file), and the corpus the tokenizer was
    trained on."""
    root = tmp_path_factory.mktemp("writers")
    with gzip.open(bundled_corpus("shakespeare"), "rt") as f:
        text = json.loads(f.readline())["text"][:40_000]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text[i : i + 2000]}) + "\n" for i in range(0, len(text), 2000)))
    (root / "cache").mkdir()
    tokenizer = build_tokenizer(
        "SentencePieceTokenizer", train_corpus=str(corpus), vocab_size=VOCAB, output_prefix=str(root / "cache" / "sp")
    )
    module = ml.GPTModule(
        ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ)
    )
    module.configure_model()
    ckpt = root / "runs" / "last.ckpt"
    save_weights_checkpoint(module, ckpt, metadata={TOKENIZER_KEY: tokenizer_spec(tokenizer)})
    return {"root": root, "ckpt": ckpt, "corpus": corpus, "cache": root / "cache", "tokenizer": tokenizer}


def _run(capsys, main, *args) -> tuple[int, str, str]:
    """A verb's ``main(argv)`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(capsys, main, *args, message: str) -> None:
    code, _, err = _run(capsys, main, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def _prune_args(ckpt, output, corpus, *extra) -> list:
    return [
        "--ckpt",
        ckpt,
        "--data",
        corpus,
        "--num-layers",
        "1",
        "--calib-batches",
        "1",
        "--eval-batches",
        "0",
        "--batch-size",
        "2",
        "--output",
        output,
        *extra,
    ]


def _quantize_args(ckpt, output, corpus, *extra) -> list:
    return [
        "--ckpt",
        ckpt,
        "--data",
        corpus,
        "--calib-batches",
        "1",
        "--eval-batches",
        "0",
        "--batch-size",
        "2",
        "--output",
        output,
        *extra,
    ]


def test_overwrite_never_deletes_an_input_or_what_megatron_lite_did_not_write(source, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(source["ckpt"].parent, runs)
    ckpt, corpus = runs / "last.ckpt", source["corpus"]
    (runs / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(runs)
    holds = "holds the input"
    # the output is the directory holding the input, directly or through a link: refused by every writer
    _refused(capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", runs, "--overwrite", message=holds)
    _refused(
        capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", tmp_path / "link", "--overwrite", message=holds
    )
    _refused(capsys, prune.main, *_prune_args(ckpt, runs, corpus, "--overwrite"), message=holds)
    _refused(capsys, quantize.main, *_quantize_args(ckpt, runs, corpus, "--overwrite"), message=holds)
    _refused(
        capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", ckpt / "hf", message="is inside the input"
    )
    _refused(capsys, prune.main, *_prune_args(ckpt, ckpt, corpus, "--overwrite"), message="is the input")
    # a directory megatron-lite did not write is never replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    _refused(
        capsys,
        convert.main,
        "--to",
        "hf",
        "--input",
        ckpt,
        "--output",
        mine,
        "--overwrite",
        message="is not an output of megatron-lite",
    )
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (runs / "notes.txt").read_text() == "mine" and verify_checkpoint(ckpt).status == "ok"

    # an earlier output is replaced with --overwrite (an HF export: by its marker; a checkpoint: by its manifest),
    # and refused without it
    hf = tmp_path / "hf"
    assert _run(capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", hf)[0] == 0
    _refused(capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", hf, message="exists and is not empty")
    assert _run(capsys, convert.main, "--to", "hf", "--input", ckpt, "--output", hf, "--overwrite")[0] == 0
    assert _run(capsys, convert.main, "--from", "hf", "--input", hf, "--output", tmp_path / "imported")[0] == 0
    assert (
        _run(capsys, convert.main, "--from", "hf", "--input", hf, "--output", tmp_path / "imported", "--overwrite")[0]
        == 0
    )
    # ... unless someone put files of their own in it
    (hf / "README.md").write_text("my model card")
    _refused(
        capsys,
        convert.main,
        "--to",
        "hf",
        "--input",
        ckpt,
        "--output",
        hf,
        "--overwrite",
        message="holds README.md, which megatron-lite did not write",
    )
    assert (hf / "README.md").is_file() and (hf / "model.safetensors").is_file()


@pytest.mark.parametrize("writer", ["prune", "quantize"])
def test_every_writer_carries_the_tokenizer_and_its_output_needs_no_cache(writer, source, tmp_path, capsys):
    if writer == "quantize":
        pytest.importorskip("modelopt.torch.quantization")
    out = tmp_path / writer
    main, args = (prune.main, _prune_args) if writer == "prune" else (quantize.main, _quantize_args)
    code, _, err = _run(capsys, main, *args(source["ckpt"], out, source["corpus"]))
    assert code == 0, err
    spec = read_checkpoint_meta(out, [ml.GPTConfig, ml.OptimizerConfig])[TOKENIZER_KEY]
    assert spec == {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "tokenizer/tokenizer.model"}
    copy = out / "tokenizer" / "tokenizer.model"
    assert copy.read_bytes() == Path(source["tokenizer"].model_path).read_bytes()
    assert "tokenizer/tokenizer.model" in read_manifest(out).files  # checksummed with the checkpoint

    moved = source["cache"].with_name("cache.gone")
    source["cache"].rename(moved)  # the cache is cleaned: the output still has its tokenizer
    try:
        code, out_text, err = _run(
            capsys, cli_generate, "--ckpt", out, "--prompt", "ROMEO:", "--max-new-tokens", "4", "--json"
        )
        assert code == 0, err
        record = json.loads(out_text.strip().splitlines()[-1])
        assert record["prompt_tokens"] == source["tokenizer"].tokenize("ROMEO:") and len(record["new_tokens"]) == 4
        if writer == "prune":  # the HF export writes the tokenizer where transformers reads it
            hf = tmp_path / "hf"
            assert _run(capsys, convert.main, "--to", "hf", "--input", out, "--output", hf)[0] == 0
            assert (hf / "tokenizer.model").read_bytes() == copy.read_bytes()
            assert json.loads((hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "LlamaTokenizer"
            transformers = pytest.importorskip("transformers")
            text = "ROMEO:\nWhat light through yonder window"
            assert transformers.AutoTokenizer.from_pretrained(hf)(text)["input_ids"] == source["tokenizer"].tokenize(
                text
            )
    finally:
        moved.rename(source["cache"])
    # a damaged copy is named by the checksums, like any file of the checkpoint
    copy.write_bytes(b"x" + copy.read_bytes()[1:])
    code, out_text, _ = _run(capsys, lambda argv: cli_exit_code(["checkpoint", "inspect", *argv]), out)
    assert code == 1 and "tokenizer/tokenizer.model: checksum mismatch" in out_text


def test_a_tokenizer_whose_files_are_gone_never_fails_a_save(source, tmp_path):
    module = ml.GPTModule.from_pretrained(source["ckpt"])
    moved = source["cache"].with_name("cache.gone")
    source["cache"].rename(moved)
    try:
        with pytest.warns(UserWarning, match=r"sp.model is gone, so the checkpoint records the tokenizer without"):
            save_weights_checkpoint(module, tmp_path / "ckpt", tokenizer=source["tokenizer"])
    finally:
        moved.rename(source["cache"])
    assert read_checkpoint_meta(tmp_path / "ckpt", [ml.GPTConfig, ml.OptimizerConfig])[TOKENIZER_KEY] == tokenizer_spec(
        source["tokenizer"]
    )
    assert verify_checkpoint(tmp_path / "ckpt").status == "ok"


def cli_generate(argv) -> int:
    return cli_exit_code(["generate", *argv])


def cli_exit_code(argv) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    return exit_info.value.code


def test_bad_input_is_one_line(source, tmp_path, capsys):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    _refused(
        capsys,
        quantize.main,
        *_quantize_args(source["ckpt"], existing, source["corpus"]),
        message=f"--output {existing} exists and is not empty",
    )
    hf = tmp_path / "hf"
    assert _run(capsys, convert.main, "--to", "hf", "--input", source["ckpt"], "--output", hf)[0] == 0
    _refused(
        capsys,
        convert.main,
        "--from",
        "hf",
        "--input",
        hf,
        "--output",
        tmp_path / "long",
        "--seq-length",
        "4096",
        message=f"--seq-length 4096 is longer than the model's context, max_position_embeddings {SEQ}",
    )
    assert not (tmp_path / "long").exists()
    pytest.importorskip("modelopt.torch.quantization")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _refused(
        capsys,
        quantize.main,
        *_quantize_args(source["ckpt"], tmp_path / "q", empty),
        message=f"--data {empty} holds no text",
    )
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "To be"}) + "\n")
    _refused(
        capsys,
        quantize.main,
        *_quantize_args(source["ckpt"], tmp_path / "q", short),
        message=f"0 windows of {SEQ} + 1 tokens, fewer than the 2",
    )
    assert not (tmp_path / "q").exists()


def test_inspect_into_a_closed_pipe_ends_quietly(source):
    """``megatron-lite checkpoint inspect CKPT | head -1``: the reader leaves before the output is written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_lite", "checkpoint", "inspect", str(source["ckpt"]), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 128 + signal.SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
