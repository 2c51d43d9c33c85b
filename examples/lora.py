"""LoRA fine-tuning of an imported model: supervised fine-tuning (SFT) on chat data made from the bundled Shakespeare
corpus, then generation with the adapters.

1. The base model: a small Llama-style GPT trained on the corpus for ``--base-steps`` steps and written as a
   Hugging Face directory (``config.json`` + ``model.safetensors``, what ``save_pretrained`` writes) -- a stand-in
   for a downloaded model, so the example needs no network. ``GPTModule.from_pretrained`` imports it.
2. The SFT data: conversations ``{"messages": [user: "Continue: <a line>", assistant: "<the next line>"]}`` from
   the plays, loss on the assistant's turns only (``SFTDataModule``, packed rows).
3. ``trainer.fit`` with ``ml.callbacks.LoRA(dim=8, alpha=16)``: adapters on every linear layer, the base frozen;
   the held-out SFT loss before and after, the trainable parameters, and a greedy reply to a held-out prompt with
   the adapters and without them (``adapters_disabled``).

    python examples/lora.py                                   # defaults: a few minutes on 2 CPU cores
    python examples/lora.py --base-steps 20 --steps 10 --new-tokens 8    # quick check
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.core.checkpoint.hf.directory import save_hf
from megatron_lite.core.peft import adapters_disabled
from megatron_lite.data import SFTDataModule, TextCorpusDataModule, bundled_corpus
from megatron_lite.tokenizers.chat import DEFAULT_CHAT_TEMPLATE, render_chat_template

SEQ_LENGTH = 128
SHAPE = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=384)


def trainer(steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        callbacks=list(callbacks),
    )


def base_model(out: Path, steps: int) -> tuple[Path, object]:
    """Train the base on the corpus and write it as a Hugging Face directory; (its path, the tokenizer)."""
    corpus = TextCorpusDataModule(
        "shakespeare",
        seq_length=SEQ_LENGTH,
        micro_batch_size=8,
        global_batch_size=16,
        vocab_size=1024,
        cache_dir=str(out / "corpus"),
    )
    corpus.prepare_data()
    corpus.setup("fit")
    directory = out / "base-hf"
    if not (directory / "config.json").is_file():
        config = ml.GPTConfig(**SHAPE, vocab_size=corpus.vocab_size, seq_length=SEQ_LENGTH)
        optimizer = ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=steps // 10, lr_decay_style="cosine")
        module = ml.GPTModule(config, optimizer, seed=1234)
        trainer(steps).fit(module, corpus)
        save_hf(directory, module.config, dict(module.model.state_dict()))
    return directory, corpus.tokenizer


def sft_file(out: Path, count: int) -> Path:
    """``count`` (line, next line) conversations from the corpus, in a random order."""
    path = out / "continue_the_line.jsonl"
    lines = []
    with gzip.open(bundled_corpus("shakespeare"), "rt") as f:
        for work in map(json.loads, f):
            text = [line.strip() for line in work["text"].splitlines()]
            lines += [(a, b) for a, b in zip(text, text[1:]) if 20 < len(a) < 80 and 20 < len(b) < 80]
    random.Random(0).shuffle(lines)
    with open(path, "w") as f:
        for line, following in lines[:count]:
            messages = [{"role": "user", "content": f"Continue: {line}"}, {"role": "assistant", "content": following}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/lora", help="where the base model, data and tokenizer are kept")
    p.add_argument("--base-steps", type=int, default=150, help="steps of the base model's pre-training")
    p.add_argument("--steps", type=int, default=60, help="LoRA fine-tuning steps")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--dim", type=int, default=8, help="LoRA rank")
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    directory, tokenizer = base_model(out, args.base_steps)
    module = ml.GPTModule.from_pretrained(
        str(directory), optimizer=ml.OptimizerConfig(lr=2e-3, lr_decay_style="constant")
    )
    sft = SFTDataModule(
        str(sft_file(out, args.conversations)),
        tokenizer,
        seq_length=SEQ_LENGTH,
        micro_batch_size=8,
        global_batch_size=16,
        split="95,5",
    )
    before = trainer(args.steps).validate(module, sft, verbose=False)[0]["val/loss"]
    lora = ml.callbacks.LoRA(dim=args.dim, alpha=2.0 * args.dim)
    trainer(args.steps, [lora]).fit(module, sft)
    after = trainer(args.steps).validate(module, sft, verbose=False)[0]["val/loss"]
    params = list(module.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    print(
        f"trainable parameters: {trainable:,} of {sum(p.numel() for p in params):,} "
        f"({100 * trainable / sum(p.numel() for p in params):.2f} %)"
    )
    print(f"held-out SFT loss: {before:.3f} (base) -> {after:.3f} (LoRA, {args.steps} steps)")

    line = "Now is the winter of our discontent"
    prompt = render_chat_template(
        DEFAULT_CHAT_TEMPLATE, [{"role": "user", "content": f"Continue: {line}"}], add_generation_prompt=True
    )
    tokens = tokenizer.tokenize(prompt)
    for name, adapted in (("with the adapters", True), ("the base alone", False)):
        if adapted:
            reply = module.generate([tokens], args.new_tokens).tokens[0]
        else:
            with adapters_disabled(module.model):
                reply = module.generate([tokens], args.new_tokens).tokens[0]
        print(f"--- {name} ---\nContinue: {line}\n-> {tokenizer.detokenize(reply)!r}")


if __name__ == "__main__":
    main()
