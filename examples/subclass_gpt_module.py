"""Extend GPTModule by subclassing: here, add PaLM's z-loss to the objective.

Only `loss_fn` changes; the microbatch schedule, gradient reduction over DP, clipping, the LR
schedule and checkpointing all come from GPTModule and MegatronStrategy.

    python examples/subclass_gpt_module.py --devices 2 --tp 2 --max-steps 20
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.mappings import reduce_from_tensor_parallel_region
from megatron_lite.data import MockGPTDataModule


class ZLossGPTModule(ml.GPTModule):
    """Next-token loss plus ``z_loss_weight * log(Z)^2`` per token (keeps the logits from drifting)."""

    def __init__(
        self,
        config: ml.GPTConfig,
        optimizer: Optional[ml.OptimizerConfig] = None,
        seed: int = 1234,
        z_loss_weight: float = 1e-4,
    ):
        super().__init__(config, optimizer, seed)
        self.z_loss_weight = z_loss_weight

    def loss_fn(self, model, microbatch):
        tokens = microbatch["tokens"]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)  # [b, s, V/tp]: this rank's slice of the vocabulary
        group = model.layout.group("tp")
        per_token = vocab_parallel_cross_entropy(logits, labels, group, model.embedding.vocab_start)
        # log Z over the full vocabulary: sum the exponentials of every TP rank's slice.
        local_max = logits.max(dim=-1, keepdim=True).values.detach()
        global_max = local_max.clone()
        if group is not None:
            torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=group)
        sum_exp = reduce_from_tensor_parallel_region((logits - global_max).exp().sum(-1), group)
        log_z = sum_exp.log() + global_max.squeeze(-1)
        loss = per_token + self.z_loss_weight * log_z.pow(2)
        return loss.sum(), torch.tensor(float(labels.numel()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ml.GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)
    module = ZLossGPTModule(config, ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(module, MockGPTDataModule(seq_length=64, micro_batch_size=2, global_batch_size=8, vocab_size=512))
    if trainer.global_rank == 0:
        print(f"final train/loss (with z-loss): {float(trainer.callback_metrics['train/loss']):.4f}")


if __name__ == "__main__":
    main()
