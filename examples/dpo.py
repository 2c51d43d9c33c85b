"""DPO on a synthetic preference set whose preferred answer is known, tensor parallel over 2 CPU processes.

Each prompt is a few random tokens and then a cue token (1..4); the preferred (chosen) reply is the
cue's answer token (11..14) repeated, the rejected reply another cue's answer. No property of a reply
alone tells chosen from rejected (every answer is chosen as often as rejected), so the policy must learn
to read the cue. The policy starts from random weights and the reference is its frozen initial copy.
Printed: held-out reward accuracy and margin (DPO's implicit rewards), and how often the policy itself
prefers the chosen reply (log pi(c) > log pi(r)) and answers a held-out prompt greedily with the right
token, before and after training.

    python examples/dpo.py [--max-steps 60] [--devices 2] [--tp 2] [--beta 0.1] [--loss-type sigmoid|ipo] [--pack]
    python examples/dpo.py --write-pairs examples/configs/dpo_pairs.jsonl   # the CLI config's data

The same run from the CLI: ``megatron-lite fit --config examples/configs/dpo.yaml`` (from the repository root).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import DPOModule
from megatron_lite.tokenizers import NullTokenizer

VOCAB = 64
CUES = (1, 2, 3, 4)
ANSWER = {cue: 10 + cue for cue in CUES}


def write_pairs(path: Path, n: int, seed: int = 0) -> str:
    """``n`` pairs of the cued task as JSONL (NullTokenizer text: the ids)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            cue = rng.choice(CUES)
            wrong = rng.choice([c for c in CUES if c != cue])
            prompt = " ".join(str(rng.randrange(20, 60)) for _ in range(rng.randint(1, 8))) + f" {cue}"
            length = rng.randint(1, 3)
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "chosen": " ".join([str(ANSWER[cue])] * length),
                        "rejected": " ".join([str(ANSWER[wrong])] * length),
                    }
                )
                + "\n"
            )
    return str(path)


class Progress(L.Callback):
    """Writes the training reward accuracy of each step and the last validation metrics to ``path`` (the
    ranks are forked processes: this script reads the file)."""

    def __init__(self, path: Path) -> None:
        self.path, self.accuracy, self.val = path, [], {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.accuracy.append(float(trainer.callback_metrics["train/reward_accuracy"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        self.val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"accuracy": self.accuracy, "val": self.val}))


@torch.no_grad()
def policy_preferences(module: DPOModule, dataset) -> tuple[float, float]:
    """(share of pairs with log pi(chosen) > log pi(rejected), share of prompts answered greedily with the
    chosen reply's first token) of the module's one-process model."""
    prefer = greedy = 0
    for item in dataset:
        logps = []
        for name in ("chosen", "rejected"):
            tokens = item[f"{name}_tokens"].unsqueeze(0)
            logits = module.full_logits(tokens[:, :-1]).float().log_softmax(-1)
            token_logps = logits.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
            logps.append(float((token_logps * item[f"{name}_loss_mask"]).sum()))
        prefer += logps[0] > logps[1]
        p = int(item["prompt_length"])
        prompt = item["chosen_tokens"][:p].tolist()
        answer = module.generate([prompt], max_new_tokens=1).tokens[0][0]
        greedy += answer == int(item["chosen_tokens"][p])
    return prefer / len(dataset), greedy / len(dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", default="sigmoid", choices=("sigmoid", "ipo"))
    parser.add_argument("--pairs", type=int, default=480)
    parser.add_argument("--out", default="runs/dpo")
    parser.add_argument(
        "--pack",
        action="store_true",
        help="pack pairs into rows of 65 tokens (batch sizes count rows: 8 rows, ~29 pairs a step)",
    )
    parser.add_argument("--write-pairs", help="only write the pairs file (JSONL) and exit")
    args = parser.parse_args()
    if args.write_pairs:
        print(f"wrote {args.pairs} pairs to {write_pairs(Path(args.write_pairs), args.pairs)}")
        return
    torch.set_num_threads(1)
    pairs = write_pairs(Path(args.out) / "pairs.jsonl", args.pairs)
    seq_length = 64 if args.pack else 16  # unpacked: the longest sequence; packed: rows of several pairs
    data = PreferenceDataModule(
        pairs,
        NullTokenizer(VOCAB),
        seq_length=seq_length,
        micro_batch_size=2 if args.pack else 8,
        global_batch_size=8 if args.pack else 32,
        split="80,20",
        seed=1,
        pack_sequences=args.pack,
    )
    config = ml.GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=seq_length)
    module = DPOModule(
        config,
        ml.OptimizerConfig(lr=3e-3, lr_warmup_iters=5, lr_decay_style="cosine", min_lr=3e-4, weight_decay=0.0),
        beta=args.beta,
        loss_type=args.loss_type,
        precompute_reference_log_probs=True,
    )
    data.setup()
    train = data.datasets["train"]
    rows = len(train) * (1 if args.pack else 2)
    print(
        f"train split: {rows} rows of {seq_length + 1} tokens, {train.padding_fraction:.1%} of them padding "
        f"({'packed pairs' if args.pack else 'one sequence per row'})"
    )
    # The same held-out pairs one per row (the split is by pair), for the policy's own preferences below.
    unpacked = PreferenceDataModule(pairs, NullTokenizer(VOCAB), seq_length=16, split="80,20", seed=1)
    unpacked.setup()
    held_out = unpacked.datasets["validation"]
    module.configure_model()
    before = policy_preferences(module, held_out)
    progress = Progress(Path(args.out) / "metrics.json")
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp, start_method="fork"),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[progress],
    )
    start = time.perf_counter()
    trainer.fit(module, data)  # the trained weights come back into this process's module
    seconds = time.perf_counter() - start
    after = policy_preferences(module, held_out)
    logged = json.loads(progress.path.read_text())
    acc, val = logged["accuracy"], logged["val"]
    print(
        f"\nDPO ({args.loss_type}, beta={args.beta}) on {args.pairs} cued pairs, TP{args.tp} over {args.devices} "
        f"processes: {args.max_steps} steps in {seconds:.0f} s"
    )
    print(f"train reward accuracy: first step {acc[0]:.2f}, mean of the last 10 steps {sum(acc[-10:]) / 10:.2f}")
    print(
        f"held-out ({len(held_out)} pairs): reward accuracy {val['val/reward_accuracy']:.3f}, "
        f"margin {val['val/reward_margin']:.2f} (chosen {val['val/rewards_chosen']:+.2f}, "
        f"rejected {val['val/rewards_rejected']:+.2f}), loss {val['val/loss']:.3f}"
    )
    print(
        f"policy prefers the chosen reply: {before[0]:.2f} before -> {after[0]:.2f} after; "
        f"greedy answer is the preferred token: {before[1]:.2f} -> {after[1]:.2f}"
    )


if __name__ == "__main__":
    main()
