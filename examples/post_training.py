"""After training, end to end on the bundled Shakespeare corpus: train -> quantize -> evaluate -> prune -> distill
-> speculative decode, each step printing its figure.

    python examples/post_training.py [--max-steps 400] [--distill-steps 150] [--devices 2 --tp 2]

(about 30 minutes on a busy 2-core machine, most of it step 1; its printed figures are in the README.)

1. train      a 6-layer GQA model (held-out loss and perplexity; the checkpoint is written to runs/post_training)
2. quantize   INT8 SmoothQuant PTQ (ModelOpt) of a copy of the trained model, calibrated on 16 training batches,
              with an FP8 KV cache; written as a quantized checkpoint
3. evaluate   held-out loss/perplexity of the trained and the quantized model
4. prune      Minitron-style to 4 layers, hidden 96, 1 query group, FFN 256 from activation statistics on 16
              calibration batches (parameters and held-out loss before/after; the pruned checkpoint is written)
5. distill    the pruned model from the trained one (Distill) against the same steps of training alone
6. speculate  an EAGLE draft head trained on the frozen distilled model (TrainDraftHead), then speculative greedy
              decoding of held-out prompts: acceptance length, and the tokens checked equal to plain greedy

Training runs on ``--devices`` forked processes (tensor parallel over ``--tp``) and hands the model back to this
process; every later step runs here, on one process.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.callbacks import Distill, TrainDraftHead
from megatron_lite.data import TextCorpusDataModule
from megatron_lite.post_training import quantize, speculative_generate
from megatron_lite.post_training.pruning import PruneTarget, prune
from megatron_lite.pretrained import save_weights_checkpoint

OUT = Path("runs/post_training")
SEQ, VOCAB = 64, 1024


def data_module() -> TextCorpusDataModule:
    return TextCorpusDataModule(
        "shakespeare",
        seq_length=SEQ,
        micro_batch_size=16,
        global_batch_size=16,
        vocab_size=VOCAB,
        cache_dir=str(OUT / "data"),
    )


def trainer(max_steps: int = -1, devices: int = 1, tp: int = 1, callbacks=(), val_batches: int = 32) -> L.Trainer:
    strategy = ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method="fork" if devices > 1 else "popen")
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )


def held_out(module: ml.GPTModule, data: TextCorpusDataModule) -> float:
    """Mean loss over the first 32 validation batches (the same tokens for every model)."""
    return trainer().validate(module, data, verbose=False)[0]["val/loss"]


def save(module: ml.GPTModule, path: Path, data) -> None:
    """An ordinary checkpoint of the weights that carries the tokenizer (``megatron-lite generate --ckpt`` reads it)."""
    save_weights_checkpoint(module, path, tokenizer=data.tokenizer)


def report(step: str, module: ml.GPTModule, loss: float, extra: str = "") -> None:
    print(
        f"[{step}] held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}), "
        f"{module.config.num_parameters():,} parameters{extra}",
        flush=True,
    )


def step_train(args, data) -> ml.GPTModule:
    config = ml.GPTConfig(
        num_layers=6,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        vocab_size=VOCAB,
        seq_length=SEQ,
    )
    module = ml.GPTModule(
        config,
        ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0),
        seed=1234,
    )
    start = time.perf_counter()
    trainer(args.max_steps, args.devices, args.tp, val_batches=0).fit(module, data)
    print(f"[1 train] {args.max_steps} steps in {time.perf_counter() - start:.0f} s on {args.devices} process(es)")
    save(module, OUT / "trained.ckpt", data)
    return module


def step_quantize(data) -> ml.GPTModule:
    """INT8 SmoothQuant PTQ (with an FP8 KV cache) of a copy of the trained model, calibrated on 16 training batches."""
    module = ml.GPTModule.from_pretrained(OUT / "trained.ckpt")
    rows = [data.train_dataset[i]["tokens"] for i in range(16 * 16)]
    calibration = [{"tokens": torch.stack(rows[i : i + 16])} for i in range(0, len(rows), 16)]
    start = time.perf_counter()
    quantize(module, "INT8_SMOOTHQUANT_CFG", calibration, kv_cache="FP8_KV_CFG")
    save(module, OUT / "int8.ckpt", data)
    print(
        f"[2 quantize] INT8_SMOOTHQUANT_CFG + FP8_KV_CFG calibrated in {time.perf_counter() - start:.1f} s; "
        f"written to {OUT / 'int8.ckpt'}",
        flush=True,
    )
    return module


def step_evaluate(module: ml.GPTModule, quantized, data) -> float:
    loss = held_out(module, data)
    report("3 evaluate: trained", module, loss)
    if quantized is not None:
        q_loss = held_out(quantized, data)
        report("3 evaluate: quantized", quantized, q_loss, f", {100 * (math.exp(q_loss - loss) - 1):+.2f}% perplexity")
    return loss


def step_prune(module: ml.GPTModule, data) -> ml.GPTModule:
    rows = [data.train_dataset[i]["tokens"] for i in range(16 * 16)]  # 16 batches of 16 training rows
    calibration = [{"tokens": torch.stack(rows[i : i + 16])} for i in range(0, len(rows), 16)]
    target = PruneTarget(num_layers=4, hidden_size=96, num_query_groups=1, ffn_hidden_size=256)
    pruned = prune(module, target, calibration, layer_metric="cosine")
    save(pruned, OUT / "pruned.ckpt", data)
    c = pruned.config
    report(
        "4 prune",
        pruned,
        held_out(pruned, data),
        f" (layers {c.num_layers}, hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_query_groups} "
        f"groups, ffn {c.ffn_hidden_size}; written to {OUT / 'pruned.ckpt'})",
    )
    return pruned


def step_distill(args, data, trained_loss: float, pruned_loss: float) -> ml.GPTModule:
    results = {}
    for name, callbacks in (("trained alone", []), ("distilled", [Distill(str(OUT / "trained.ckpt"))])):
        student = ml.GPTModule.from_pretrained(OUT / "pruned.ckpt").train()  # Distill teaches in training mode
        student.optimizer_config = ml.OptimizerConfig(
            lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0
        )
        trainer(args.distill_steps, callbacks=callbacks, val_batches=0).fit(student, data)
        results[name] = (student, held_out(student, data))
        report(f"5 distill: pruned + {args.distill_steps} steps {name}", student, results[name][1])
    gap = pruned_loss - trained_loss
    recovered = (pruned_loss - results["distilled"][1]) / gap if gap > 0 else float("nan")
    print(f"[5 distill] pruning cost {gap:.4f} held-out loss; distillation recovered {100 * recovered:.0f}% of it")
    return results["distilled"][0]


def step_speculate(args, module: ml.GPTModule, data) -> None:
    """Train an EAGLE draft head on the frozen distilled model, then decode held-out prompts speculatively."""
    module.optimizer_config = ml.OptimizerConfig(
        lr=3e-3, min_lr=3e-4, lr_warmup_iters=min(10, args.draft_steps // 2), weight_decay=0.0, clip_grad=1.0
    )  # the head's only: the base is frozen
    trainer(args.draft_steps, callbacks=[TrainDraftHead()], val_batches=0).fit(module, data)
    module.model.eval()
    tokenizer = data.tokenizer
    prompts = [data.val_dataset[i]["tokens"][:16].tolist() for i in range(4)]  # held-out text
    greedy = module.generate(prompts, 32).tokens
    for k in (2, 4):
        accepted, equal = [], True
        for prompt, expected in zip(prompts, greedy):
            result = speculative_generate(module, [prompt], 32, num_draft_tokens=k)
            equal &= result.tokens[0] == expected
            accepted.append(result.acceptance_length)
        print(
            f"[6 speculate] {k} draft tokens: acceptance length {sum(accepted) / len(accepted):.2f} tokens per base "
            f"forward, output {'equal to' if equal else 'DIFFERENT FROM'} plain greedy",
            flush=True,
        )
    print(f"[6 speculate] {tokenizer.detokenize(prompts[0] + greedy[0])!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=400, help="training steps of step 1")
    parser.add_argument("--distill-steps", type=int, default=150, help="steps of step 5 (each of its two runs)")
    parser.add_argument("--draft-steps", type=int, default=150, help="draft-head training steps of step 6")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size of step 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    data = data_module()
    module = step_train(args, data)
    module = ml.GPTModule.from_pretrained(OUT / "trained.ckpt")  # one process from here on
    quantized = step_quantize(data)
    trained_loss = step_evaluate(module, quantized, data)
    pruned = step_prune(module, data)
    distilled = step_distill(args, data, trained_loss, held_out(pruned, data))
    step_speculate(args, distilled, data)


if __name__ == "__main__":
    main()
