"""`make demo`: train a small GPT on Shakespeare with tensor parallelism over 2 CPU processes.

The Megatron data pipeline end to end: train a SentencePiece tokenizer on the bundled corpus,
tokenize it into Megatron's .bin/.idx files with 2 worker processes (what
`megatron-lite preprocess` does), and train on a GPTDataset through PretrainDataModule.

Every rank runs this script (Lightning's default launcher re-runs it per rank): the data is
prepared by the launching process before any rank starts, the others find it ready; the
generation at the end (a greedy and a sampled continuation, with a KV cache) runs on both
tensor-parallel ranks and rank 0 prints it.

    python examples/demo.py [--max-steps 800] [--devices 2] [--tp 2]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.data import PretrainDataModule, bundled_corpus
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.preprocess import preprocess
from megatron_lite.tokenizers import Tokenizer, build_tokenizer

VOCAB_SIZE = 2048


def prepare_data(out_dir: Path) -> tuple[Tokenizer, str]:
    """Tokenizer and .bin/.idx prefix of the bundled corpus, built once and reused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = bundled_corpus("shakespeare")
    model = out_dir / "shakespeare_spm.model"
    launching = os.environ.get("LOCAL_RANK", "0") == "0"
    if not model.is_file() and launching:
        build_tokenizer(
            "SentencePieceTokenizer",
            train_corpus=corpus,
            vocab_size=VOCAB_SIZE,
            output_prefix=str(out_dir / "shakespeare_spm"),
        )
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))
    prefix = str(out_dir / "shakespeare")
    if not IndexedDataset.exists(f"{prefix}_text_document") and launching:
        result = preprocess([corpus], prefix, tokenizer, workers=2, append_eod=True, progress=False)
        print(
            f"preprocessed {result.documents['text']} documents into {prefix}_text_document.bin/.idx "
            f"({result.tokens['text']:,} tokens, {result.tokens_per_second:,.0f} tokens/s)"
        )
    return tokenizer, f"{prefix}_text_document"


class LossSummary(L.Callback):
    """Remembers the first and the last training losses for the closing summary."""

    def __init__(self) -> None:
        self.first: list[float] = []
        self.last: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = float(outputs["loss"])
        if len(self.first) < 10:
            self.first.append(loss)
        self.last = (self.last + [loss])[-10:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2, help="tensor_model_parallel_size")
    parser.add_argument("--prompt", default="ROMEO:\nWhat light through yonder")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1, help="seed of the sampled continuation")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores

    tokenizer, data_prefix = prepare_data(Path("runs/demo/data"))
    data = PretrainDataModule(
        [data_prefix],
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
    module = ml.GPTModule(
        config,
        ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20, weight_decay=0.1, adam_beta2=0.95),
        seed=1234,
    )
    summary = LossSummary()
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        val_check_interval=100,
        limit_val_batches=4,
        log_every_n_steps=10,
        default_root_dir="runs/demo",
        enable_model_summary=False,
        # runs/demo/checkpoints/last.ckpt: the checkpoint the guides' generation and post-training examples load
        callbacks=[summary, ModelCheckpoint(dirpath="runs/demo/checkpoints", save_last=True)],
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    minutes = (time.perf_counter() - start) / 60

    # Every rank of the TP group generates (each holds half of every layer); they get the same tokens.
    prompt = tokenizer.tokenize(args.prompt)
    greedy = module.generate([prompt], args.new_tokens, stop_ids=[tokenizer.eod]).tokens[0]
    sampled = module.generate(
        [prompt], args.new_tokens, temperature=0.8, top_p=0.9, seed=args.seed, stop_ids=[tokenizer.eod]
    ).tokens[0]
    if trainer.global_rank == 0:
        first, last = sum(summary.first) / len(summary.first), sum(summary.last) / len(summary.last)
        print(f"\nTrained {trainer.global_step} steps in {minutes:.1f} min with {module.parallel_layout.describe()}")
        print(f"train loss: {first:.3f} (mean of first 10 steps) -> {last:.3f} (mean of last 10)")
        print("\n--- greedy continuation ---")
        print(tokenizer.detokenize(prompt + greedy))
        print(f"\n--- sampled continuation (temperature 0.8, top-p 0.9, seed {args.seed}) ---")
        print(tokenizer.detokenize(prompt + sampled))


if __name__ == "__main__":
    main()
