"""A user script: `Trainer(strategy="megatron")` by name, launched the default way (each rank
re-runs this script). Writes rank 0's per-step losses and the layout to the file in argv[1]."""

import json
import sys

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


if __name__ == "__main__":
    torch.set_num_threads(1)
    losses = Losses()
    trainer = L.Trainer(
        strategy="megatron",
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[losses],
    )
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16)
    trainer.fit(
        ml.GPTModule(config), MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    )
    if trainer.global_rank == 0:
        layout = trainer.strategy.parallel_layout
        with open(sys.argv[1], "w") as f:
            json.dump(
                {
                    "losses": losses.losses,
                    "strategy": type(trainer.strategy).__name__,
                    "dp": layout.dp_size,
                    "tp": layout.tp_size,
                    "world_size": layout.world_size,
                    "cluster": type(trainer.strategy.cluster_environment).__name__,
                },
                f,
            )
