"""Knowledge distillation on the bundled Shakespeare corpus: train a teacher, then a smaller student twice with the
same seed, data and steps -- alone, and with ``Distill(teacher=<the teacher's checkpoint>)`` -- and print the
held-out losses. Tensor parallel over 2 CPU processes by default.

    python examples/distill.py                       # the README's figures (a few minutes on 2 cores)
    python examples/distill.py --teacher-steps 40 --student-steps 20 --pairs   # quick, with a layer pair
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.callbacks import Distill
from megatron_lite.data import TextCorpusDataModule

VOCAB = 1024


def data(cache: str) -> TextCorpusDataModule:
    return TextCorpusDataModule(
        "shakespeare", seq_length=64, micro_batch_size=8, global_batch_size=16, vocab_size=VOCAB, cache_dir=cache
    )


def module(layers: int, hidden: int, heads: int, seed: int) -> ml.GPTModule:
    config = ml.GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=VOCAB,
        seq_length=64,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
    )
    return ml.GPTModule(
        config,
        ml.OptimizerConfig(
            lr=3e-3, min_lr=3e-4, lr_warmup_iters=10, lr_decay_style="cosine", weight_decay=0.1, clip_grad=1.0
        ),
        seed=seed,
    )


def trainer(args, steps: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp, start_method="fork"),
        accelerator="cpu",
        devices=args.devices,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kwargs,
    )


def held_out(args, model: ml.GPTModule, cache: str) -> float:
    """The mean loss over the validation split's first 16 batches (4096 tokens x 16)."""
    metrics = trainer(args, 1, enable_checkpointing=False, limit_val_batches=16).validate(
        model, data(cache), verbose=False
    )
    return float(metrics[0]["val/loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--student-steps", type=int, default=150)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--kd-loss-scale", type=float, default=1.0)
    parser.add_argument("--pairs", action="store_true", help="also match student layer 1 to teacher layer 3 (cosine)")
    parser.add_argument("--workdir", default=None, help="where the corpus cache and teacher checkpoint go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="distill_"))
    cache = str(work / "cache")

    teacher = module(4, 128, 4, seed=1)
    save = ModelCheckpoint(dirpath=work / "teacher", filename="last", every_n_train_steps=args.teacher_steps)
    trainer(args, args.teacher_steps, [save], limit_val_batches=0).fit(teacher, data(cache))
    teacher_path = work / "teacher" / "last.ckpt"

    alone = module(2, 64, 4, seed=2)
    trainer(args, args.student_steps, enable_checkpointing=False, limit_val_batches=0).fit(alone, data(cache))
    distilled = module(2, 64, 4, seed=2)
    pairs = [("layers.1", "layers.3")] if args.pairs else []
    distill = Distill(
        str(teacher_path),
        temperature=args.temperature,
        kd_loss_scale=args.kd_loss_scale,
        intermediate_layer_pairs=pairs,
    )
    run = trainer(args, args.student_steps, [distill], enable_checkpointing=False, limit_val_batches=0)
    run.fit(distilled, data(cache))
    parts = {k: float(v) for k, v in run.callback_metrics.items() if k.startswith("train/") and "loss" in k}

    figures = {
        "teacher (4x128)": held_out(args, teacher, cache),
        "student alone (2x64)": held_out(args, alone, cache),
        "student distilled (2x64)": held_out(args, distilled, cache),
    }
    print(
        f"\nteacher {args.teacher_steps} steps, students {args.student_steps} steps, TP{args.tp}, "
        f"T={args.temperature}, kd_loss_scale={args.kd_loss_scale}, pairs={pairs}"
    )
    print("last distillation step: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(parts.items())))
    for name, loss in figures.items():
        print(f"held-out loss {name:26s} {loss:.3f}  (perplexity {math.exp(loss):.1f})")


if __name__ == "__main__":
    main()
