"""The working directory the docs' snippets and commands run in: the files the pages name, at tiny sizes.

    runs/demo/data/shakespeare_spm.model     the SentencePiece tokenizer `make demo` trains (vocabulary 2048)
    runs/demo/data/shakespeare_text_document the demo's .bin/.idx data
    runs/demo/checkpoints/last.ckpt          the demo's checkpoint: its 4-layer model, trained 2 steps here
    runs/sft/checkpoints/last.ckpt           the same model, as the RLHF page's fine-tuned starting point
    SmolLM2-135M/                            a Hugging Face Llama directory (the demo model, exported)
    tokenizer.model                          the demo's tokenizer again, under the name the RLHF page uses
    corpus.jsonl.gz                          a slice of the bundled corpus (100 documents of 4 KB)
    data/a_text_document, data/b_text_document   its two halves, GPT-2 BPE tokenized
    prefs.jsonl, prompts.jsonl               text preference pairs; `a+b=` prompts with their answers
    examples/, tests/, megatron_lite/        links into the repository, for the paths the configs use

It is built once per test module (:func:`build`) and each page gets a copy of its own (:func:`copy`, hard
links: nothing here is written in place, checkpoints and caches are written as new files).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPT2 = REPO / "tests" / "data" / "tokenizers" / "gpt2"


def _corpus_slice(path: Path, documents: int = 100, chars: int = 4000) -> list[dict]:
    """The first ``documents`` 4 KB pieces of the bundled plays, written as JSONL.gz."""
    from megatron_lite.data import bundled_corpus

    pieces = []
    with gzip.open(bundled_corpus("shakespeare"), "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            pieces += [text[i : i + chars] for i in range(0, len(text) - chars, chars)][:10]
            if len(pieces) >= documents:
                break
    records = [{"text": piece} for piece in pieces[:documents]]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records


def build(root: Path) -> Path:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import megatron_lite as ml
    from megatron_lite.cli.convert import to_hf
    from megatron_lite.data import PretrainDataModule
    from megatron_lite.data.preprocess import preprocess
    from megatron_lite.tokenizers import build_tokenizer

    root.mkdir(parents=True)
    for name in ("examples", "tests", "megatron_lite"):
        (root / name).symlink_to(REPO / name)
    records = _corpus_slice(root / "corpus.jsonl.gz")
    for half, part in (("a", records[:50]), ("b", records[50:])):
        (root / f"{half}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(GPT2 / "vocab.json"), merge_file=str(GPT2 / "merges.txt"))
    (root / "data").mkdir()
    for half in ("a", "b"):
        preprocess([str(root / f"{half}.jsonl")], str(root / "data" / half), gpt2, append_eod=True, progress=False)
        (root / f"{half}.jsonl").unlink()

    demo = root / "runs" / "demo"
    (demo / "data").mkdir(parents=True)
    build_tokenizer(
        "SentencePieceTokenizer",
        train_corpus=str(root / "corpus.jsonl.gz"),
        vocab_size=2048,
        output_prefix=str(demo / "data" / "shakespeare_spm"),
    )
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(demo / "data" / "shakespeare_spm.model"))
    preprocess(
        [str(root / "corpus.jsonl.gz")], str(demo / "data" / "shakespeare"), tokenizer, append_eod=True, progress=False
    )
    shutil.copyfile(demo / "data" / "shakespeare_spm.model", root / "tokenizer.model")

    # examples/demo.py's model and data, 2 steps in one process
    data = PretrainDataModule(
        [str(demo / "data" / "shakespeare_text_document")],
        seq_length=128,
        micro_batch_size=8,
        global_batch_size=16,
        split="98,2",
        tokenizer=tokenizer,
        seed=1234,
    )
    config = ml.GPTConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        vocab_size=tokenizer.vocab_size,
        seq_length=128,
    )
    module = ml.GPTModule(config, ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1), seed=1234)
    trainer = L.Trainer(
        strategy="megatron",
        accelerator="cpu",
        devices=1,
        max_steps=2,
        default_root_dir=str(demo),
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(demo / "checkpoints"), save_last=True)],
    )
    trainer.fit(module, data)
    checkpoint = demo / "checkpoints" / "last.ckpt"
    shutil.copytree(checkpoint, root / "runs" / "sft" / "checkpoints" / "last.ckpt", copy_function=os.link)
    to_hf(str(checkpoint), str(root / "SmolLM2-135M"))

    pairs = [
        {
            "prompt": f"Question {i}: which word is kind?",
            "chosen": f" Gentle, friend {i}.",
            "rejected": f" Villain {i}!",
        }
        for i in range(500)
    ]
    (root / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


def copy(base: Path, dst: Path) -> Path:
    """A working directory of its own for one page: hard links to the files, the links kept as links."""
    shutil.copytree(base, dst, symlinks=True, copy_function=os.link)
    return dst
