"""GRPO on CPU in minutes: teach a tiny random GPT to answer ``a+b=`` (a, b <= 3 by default) with the sum.

Each step samples ``group_size`` answers per prompt from the current weights (our KV-cache generation),
scores them with ``exact_match`` against the prompt's answer, and takes one optimizer step on the GRPO
loss; the mean reward of the rollout is printed per step, and pass@k on 4 held-out prompts at the end.

    python examples/grpo.py [--steps 80] [--devices 2 --tp 2] [--beta 0.02] [--updates-per-batch 2] [--with-eod]

The answer is one token (every sum is a single digit). ``--with-eod`` asks for the digit AND the end token (a
strict format, 2 new tokens): a random model almost never produces it, so the reward then adds 0.2 for any
single digit followed by the end token (``WeightedRewards``: format first, then the sum).
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import RLPromptDataModule
from megatron_lite.rl import GRPOConfig, GRPOModule
from megatron_lite.rl.rewards import RegexReward, WeightedRewards, exact_match
from megatron_lite.rl.tasks import AdditionTask


class PrintRewards(L.Callback):
    """Rank 0 prints every rollout's metrics."""

    def __init__(self):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            m = {k: float(v) for k, v in trainer.callback_metrics.items()}
            print(
                f"step {trainer.global_step:4d}  reward {m['train/reward_mean']:.3f} ± {m['train/reward_std']:.3f}  "
                f"nonzero groups {m['train/nonzero_groups_ratio']:.2f}  entropy {m['train/entropy']:.3f}  "
                f"kl {m['train/kl']:.4f}  clip lo/hi {m['train/clip_fraction_low']:.3f}/"
                f"{m['train/clip_fraction_high']:.3f}  len {m['train/response_length']:.2f}  "
                f"[{time.perf_counter() - self.start:.0f} s]",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--max-operand", type=int, default=3, help="a, b <= this (<= 4 keeps every sum one digit)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.0, help="k3 KL weight (> 0 builds a reference model)")
    parser.add_argument("--updates-per-batch", type=int, default=1, help="mu: optimizer steps per rollout")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--with-eod", action="store_true", help="answer = digit + end token (strict format)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if not 1 <= args.max_operand <= 4:
        parser.error("--max-operand must be 1..4 (the answer is one digit)")
    task = AdditionTask(max_operand=args.max_operand, seed=0)
    train, held_out = task.split(4)
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=task.tokenizer.vocab_size,
        seq_length=8,
        make_vocab_size_divisible_by=8,
    )
    data = RLPromptDataModule(
        task.tokenizer, rows=train, val_rows=held_out, seq_length=8, micro_batch_size=4, global_batch_size=8
    )
    reward = task.reward
    if args.with_eod:  # exact_match needs the end token right after the digit; shaped: a lone digit earns 0.2
        reward = WeightedRewards({exact_match: 1.0, RegexReward(r"\d"): 0.2})
    grpo = GRPOConfig(
        group_size=args.group_size,
        max_new_tokens=2 if args.with_eod else 1,
        beta=args.beta,
        updates_per_batch=args.updates_per_batch,
        clip_eps_high=0.28,
        eval_samples=4,
    )
    module = GRPOModule(
        config,
        seed=7,
        grpo=grpo,
        reward_fn=reward,
        optimizer=ml.OptimizerConfig(lr=args.lr, lr_decay_style="constant", weight_decay=0.0, clip_grad=1.0),
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[PrintRewards()],
    )
    trainer.fit(module, data)
    # pass@4 on the held-out prompts (never trained on), with the trained weights handed back to this process
    validator = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp),
        accelerator="cpu",
        devices=args.devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    metrics = validator.validate(module, data, verbose=False)[0]
    rank0 = validator.global_rank == 0
    if rank0:
        print(f"held-out prompts: pass@4 {metrics['val/pass_at_k']:.3f}, mean reward {metrics['val/reward_mean']:.3f}")
    for name, rows in (("training", train), ("held-out", held_out)):
        # every rank of the model calls generate alike (under TP each holds a shard); rank 0 prints
        prompts = [task.tokenizer.tokenize(row["prompt"]) for row in rows]
        answers = module.generate(prompts, max_new_tokens=grpo.max_new_tokens, stop_ids=[task.tokenizer.eod])
        right = [
            task.tokenizer.detokenize([t for t in tokens if t != task.tokenizer.eod]) == row["answer"]
            for row, tokens in zip(rows, answers.tokens)
        ]
        if rank0:
            print(f"greedy accuracy on the {len(rows)} {name} prompts: {sum(right) / len(rows):.2f}")


if __name__ == "__main__":
    main()
