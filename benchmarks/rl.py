#!/usr/bin/env python
"""GRPO step anatomy: rollout tokens/s and the share of a step spent generating vs training, TP1 and TP2.

One GRPO step of :class:`~megatron_lite.rl.GRPOModule` = sample ``--group-size`` responses for each of
``--prompts`` prompts through the KV-cache generation (the current weights, no copy), score them, recompute
the old log-probs with the trainer's forward, then ``--updates`` engine train steps. A subclass times each
phase with ``time.perf_counter`` (wall) per step; the first ``--warmup`` steps are dropped; step times are
medians, the shares are each phase's total over the measured steps' total (``train`` = the rest of the step:
the optimizer steps' forward, backward, reduction and update). ``rollout tokens/s`` = generated tokens (all ranks of
one replica generate the same ones) / generation time. TP2 runs on 2 forked ranks (gloo) and rank 0 writes its timings
to a file.

The model is random (``--hidden-size`` 256, ``--num-layers`` 4, vocabulary 4096), prompts are random ids
(NullTokenizer) of 16 tokens, and the reward is the share of even token ids in the response: cheap, never a
zero-variance group, so every step trains on the whole batch. Responses run to ``--new-tokens`` unless the
model happens to sample the stop id (the last one, 1 in 4096). One torch thread per process; nothing is
asserted.

Run from the repository root: ``python benchmarks/rl.py [--steps 6] [--skip-tp]``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.data import RLPromptDataModule  # noqa: E402
from megatron_lite.rl import GRPOConfig, GRPOModule  # noqa: E402
from megatron_lite.tokenizers import NullTokenizer  # noqa: E402

PHASES = ("generate", "score", "old_log_probs", "train")


def even_share(sample) -> float:
    """Share of even token ids in the response (a cheap reward with spread inside every group)."""
    ids = sample.completion_ids
    return sum(1 for i in ids if i % 2 == 0) / max(1, len(ids))


class TimedGRPO(GRPOModule):
    """GRPOModule with a wall-clock stopwatch around each phase of a step."""

    def __init__(self, *args, out_file: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_file, self.steps, self._current = out_file, [], {}

    def _timed(self, phase, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - start

    def _sample(self, *args):
        return self._timed("generate", super()._sample, *args)

    def _score(self, *args):
        return self._timed("score", super()._score, *args)

    def _log_probs(self, *args):
        return self._timed("old_log_probs", super()._log_probs, *args)

    def training_step(self, batch, batch_idx):
        self._current = {}
        start = time.perf_counter()
        loss = super().training_step(batch, batch_idx)
        total = time.perf_counter() - start
        self._current["train"] = total - sum(self._current.values())
        self._current["total"] = total
        self.steps.append(dict(self._current))
        return loss

    def on_train_end(self):
        if self.trainer.global_rank == 0:
            Path(self.out_file).write_text(json.dumps({"steps": self.steps, "threads": torch.get_num_threads()}))


def run(args, tp: int) -> dict:
    torch.set_num_threads(1)
    vocab = 4096
    tokenizer = NullTokenizer(vocab)
    g = torch.Generator().manual_seed(0)
    rows = [
        {"prompt": " ".join(str(int(i)) for i in torch.randint(0, vocab - 1, (16,), generator=g))}
        for _ in range(4 * args.prompts)
    ]
    config = ml.GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=8,
        vocab_size=vocab,
        seq_length=16 + args.new_tokens,
        make_vocab_size_divisible_by=128,
    )
    data = RLPromptDataModule(
        tokenizer,
        rows=rows,
        seq_length=config.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.prompts,
    )
    grpo = GRPOConfig(
        group_size=args.group_size, max_new_tokens=args.new_tokens, updates_per_batch=args.updates, stop_ids=[vocab - 1]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "steps.json")
        module = TimedGRPO(
            config,
            seed=1234,
            grpo=grpo,
            reward_fn=even_share,
            out_file=out,
            optimizer=ml.OptimizerConfig(lr=1e-4, lr_decay_style="constant"),
        )
        trainer = L.Trainer(
            strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method="fork"),
            accelerator="cpu",
            devices=tp,
            max_steps=args.steps * args.updates,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(module, data)
        recorded = json.loads(Path(out).read_text())
    steps = recorded["steps"][args.warmup :]
    medians = {k: statistics.median(s[k] for s in steps) for k in (*PHASES, "total")}
    tokens = args.prompts * args.group_size * args.new_tokens
    return {
        "tp": tp,
        "steps": recorded["steps"],
        "median_s": medians,
        "rollout_tokens": tokens,
        "rollout_tokens_per_s": tokens / medians["generate"],
        "share": {k: sum(s_[k] for s_ in steps) / sum(s_["total"] for s_ in steps) for k in PHASES},
        "threads": recorded["threads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=1, help="optimizer steps per rollout (mu)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="prompts per microbatch")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/rl.json")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    runs = [run(args, 1)] + ([] if args.skip_tp else [run(args, 2)])
    print(
        f"\nGRPO step: {args.prompts} prompts x {args.group_size} samples x {args.new_tokens} new tokens, "
        f"{args.updates} update(s); model hidden {args.hidden_size}, {args.num_layers} layers; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'layout':8} {'step s':>8} {'generate':>9} {'score':>7} {'old lp':>7} {'train':>7} {'rollout tok/s':>14}")
    for r in runs:
        m, s = r["median_s"], r["share"]
        print(
            f"{'TP' + str(r['tp']):8} {m['total']:8.3f} {s['generate']:8.0%} {s['score']:7.0%} "
            f"{s['old_log_probs']:7.0%} {s['train']:7.0%} {r['rollout_tokens_per_s']:14.0f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "config": vars(args),
                "machine": {
                    "torch": torch.__version__,
                    "lightning": L.__version__,
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_average": os.getloadavg(),
                },
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
