"""Write your own LightningModule around the core model (no GPTModule).

What MegatronStrategy gives you: `self.trainer.strategy.parallel_layout` (sizes, ranks, process
groups). What you call from megatron_lite.core: the model built for that layout, the microbatch
schedule (it runs the backward passes), gradient finalization over DP, and global-norm clipping.
Manual optimization keeps Lightning from running a second backward.

    python examples/own_lightning_module.py --devices 2 --tp 2 --max-steps 20
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.core.optim import clip_grad_norm
from megatron_lite.core.parallel.data_parallel import finalize_model_grads
from megatron_lite.core.parallel.schedules import forward_backward_no_pipelining, split_microbatches
from megatron_lite.data import MockGPTDataModule


class MyGPT(L.LightningModule):
    def __init__(self, config: ml.GPTConfig, lr: float = 1e-3, micro_batch_size: int = 2):
        super().__init__()
        self.config, self.lr, self.micro_batch_size = config, lr, micro_batch_size
        self.automatic_optimization = False
        self.model = None

    def configure_model(self):
        # Build only this rank's shards: the layout says which.
        self.layout = self.trainer.strategy.parallel_layout
        self.model = ml.GPTModel(self.config, self.layout, seed=42)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        microbatches = split_microbatches(batch, self.micro_batch_size)
        step = forward_backward_no_pipelining(self.model, microbatches, self.layout)  # does the backward
        finalize_model_grads(self.model, self.layout)  # sum gradients over data-parallel ranks
        grad_norm = clip_grad_norm(self.model.parameters(), 1.0, self.layout)
        opt.step()
        self.log_dict({"train/loss": step.loss, "train/grad_norm": grad_norm}, prog_bar=True)
        return step.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ml.GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=args.tp),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(
        MyGPT(config), MockGPTDataModule(seq_length=64, micro_batch_size=2, global_batch_size=8, vocab_size=512)
    )
    if trainer.global_rank == 0:
        print(f"final train/loss: {float(trainer.callback_metrics['train/loss']):.4f}")


if __name__ == "__main__":
    main()
