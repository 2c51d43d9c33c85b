"""After training, end to end on the bundled Shakespeare corpus: train -> quantize -> evaluate -> prune -> distill
-> speculative decode, each step printing its figure.

    python examples/post_training.py [--max-steps 400] [--distill-steps 150] [--devices 2 --tp 2]

(about 30 minutes on a busy 2-core machine, most of it step 1; its printed figures are in the README.)

1. train      a 6-layer GQA model (held-out loss and perplexity; the checkpoint is written to runs/post_training)
2. quantize   (left to the lead: needs megatron_lite.callbacks.Quantize from branch "quantize")
3. evaluate   held-out loss/perplexity of the trained model (and, once step 2 is in, of the quantized one)
4. prune      Minitron-style to 4 layers, hidden 96, 1 query group, FFN 256 from activation statistics on 16
              calibration batches (parameters and held-out loss before/after; the pruned checkpoint is written)
5. distill    the pruned model from the trained one (Distill) against the same steps of training alone
6. speculate  (left to the lead: needs the draft head and speculative generation from branch "speculative")

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
from megatron_lite.callbacks import Distill
from megatron_lite.data import TextCorpusDataModule
from megatron_lite.post_training.pruning import PruneTarget, prune
from megatron_lite.module import TOKENIZER_KEY
from megatron_lite.pretrained import save_weights_checkpoint
from megatron_lite.tokenizers.build import tokenizer_spec

OUT = Path("runs/post_training")
SEQ, VOCAB = 64, 1024


def data_module() -> TextCorpusDataModule:
    return TextCorpusDataModule("shakespeare", seq_length=SEQ, micro_batch_size=16, global_batch_size=16,
                                vocab_size=VOCAB, cache_dir=str(OUT / "data"))


def trainer(max_steps: int = -1, devices: int = 1, tp: int = 1, callbacks=(), val_batches: int = 32) -> L.Trainer:
    strategy = ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method="fork" if devices > 1 else "popen")
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     limit_val_batches=val_batches, num_sanity_val_steps=0, callbacks=list(callbacks))


def held_out(module: ml.GPTModule, data: TextCorpusDataModule) -> float:
    """Mean loss over the first 32 validation batches (the same tokens for every model)."""
    return trainer().validate(module, data, verbose=False)[0]["val/loss"]


def save(module: ml.GPTModule, path: Path, data) -> None:
    """An ordinary checkpoint of the weights that remembers the tokenizer (``megatron-lite generate --ckpt`` reads it)."""
    save_weights_checkpoint(module, path, metadata={TOKENIZER_KEY: tokenizer_spec(data.tokenizer)})


def report(step: str, module: ml.GPTModule, loss: float, extra: str = "") -> None:
    print(f"[{step}] held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}), "
          f"{module.config.num_parameters():,} parameters{extra}", flush=True)


def step_train(args, data) -> ml.GPTModule:
    config = ml.GPTConfig(num_layers=6, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=352, vocab_size=VOCAB, seq_length=SEQ)
    module = ml.GPTModule(config, ml.OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20, weight_decay=0.1,
                                                     adam_beta2=0.95, clip_grad=1.0), seed=1234)
    start = time.perf_counter()
    trainer(args.max_steps, args.devices, args.tp, val_batches=0).fit(module, data)
    print(f"[1 train] {args.max_steps} steps in {time.perf_counter() - start:.0f} s on {args.devices} process(es)")
    save(module, OUT / "trained.ckpt", data)
    return module


def step_quantize(module: ml.GPTModule, data) -> None:
    """LEFT TO THE LEAD (branch "quantize"): PTQ of a copy of ``module``, e.g.
    ``GPTModule.from_pretrained(OUT / "trained.ckpt")`` + ``trainer(callbacks=[Quantize("INT8_SMOOTHQUANT_CFG",
    calib_batches=16)])``, returned so that step 3 reports its held-out loss beside the unquantized model's."""
    print("[2 quantize] skipped: megatron_lite.callbacks.Quantize is not merged in this branch")
    return None


def step_evaluate(module: ml.GPTModule, quantized, data) -> float:
    loss = held_out(module, data)
    report("3 evaluate: trained", module, loss)
    if quantized is not None:
        q_loss = held_out(quantized, data)
        report("3 evaluate: quantized", quantized, q_loss, f", {100 * (math.exp(q_loss - loss) - 1):+.2f}% perplexity")
    return loss


def step_prune(module: ml.GPTModule, data) -> ml.GPTModule:
    rows = [data.train_dataset[i]["tokens"] for i in range(16 * 16)]  # 16 batches of 16 training rows
    calibration = [{"tokens": torch.stack(rows[i:i + 16])} for i in range(0, len(rows), 16)]
    target = PruneTarget(num_layers=4, hidden_size=96, num_query_groups=1, ffn_hidden_size=256)
    pruned = prune(module, target, calibration, layer_metric="cosine")
    save(pruned, OUT / "pruned.ckpt", data)
    c = pruned.config
    report("4 prune", pruned, held_out(pruned, data),
           f" (layers {c.num_layers}, hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_query_groups} "
           f"groups, ffn {c.ffn_hidden_size}; written to {OUT / 'pruned.ckpt'})")
    return pruned


def step_distill(args, data, trained_loss: float, pruned_loss: float) -> ml.GPTModule:
    results = {}
    for name, callbacks in (("trained alone", []), ("distilled", [Distill(str(OUT / "trained.ckpt"))])):
        student = ml.GPTModule.from_pretrained(OUT / "pruned.ckpt").train()  # Distill teaches in training mode
        student.optimizer_config = ml.OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, weight_decay=0.1,
                                                      adam_beta2=0.95, clip_grad=1.0)
        trainer(args.distill_steps, callbacks=callbacks, val_batches=0).fit(student, data)
        results[name] = (student, held_out(student, data))
        report(f"5 distill: pruned + {args.distill_steps} steps {name}", student, results[name][1])
    gap = pruned_loss - trained_loss
    recovered = (pruned_loss - results["distilled"][1]) / gap if gap > 0 else float("nan")
    print(f"[5 distill] pruning cost {gap:.4f} held-out loss; distillation recovered {100 * recovered:.0f}% of it")
    return results["distilled"][0]


def step_speculate(module: ml.GPTModule, data) -> None:
    """LEFT TO THE LEAD (branch "speculative"): train a draft head on the frozen ``module`` (its callback), then
    speculative greedy decoding of held-out prompts: print the acceptance length and check the tokens equal
    ``module.generate(prompts, n)``'s greedy output."""
    tokenizer = data.tokenizer
    prompt = tokenizer.tokenize("ROMEO:\nWhat light through yonder")
    tokens = module.generate([prompt], 24, stop_ids=[tokenizer.eod]).tokens[0]
    print(f"[6 speculate] skipped (branch speculative not merged); greedy from the distilled model: "
          f"{tokenizer.detokenize(prompt + tokens)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=400, help="training steps of step 1")
    parser.add_argument("--distill-steps", type=int, default=150, help="steps of step 5 (each of its two runs)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size of step 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    data = data_module()
    module = step_train(args, data)
    module = ml.GPTModule.from_pretrained(OUT / "trained.ckpt")  # one process from here on
    quantized = step_quantize(module, data)
    trained_loss = step_evaluate(module, quantized, data)
    pruned = step_prune(module, data)
    distilled = step_distill(args, data, trained_loss, held_out(pruned, data))
    step_speculate(distilled, data)


if __name__ == "__main__":
    main()
