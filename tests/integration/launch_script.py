"""A user script run with Lightning's default launcher (each rank re-runs it), for the launch tests.

python launch_script.py fit-twice   # TP2 fit, generate, fit again, generate; rank<r>.txt
python launch_script.py boom RANK   # rank RANK raises ValueError("boom ...") at step 2
"""

import sys

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule


class Boom(ml.GPTModule):
    def __init__(self, config, rank: int):
        super().__init__(config)
        self.boom_rank = rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.boom_rank and batch_idx == 2:
            raise ValueError(f"boom at step {batch_idx} on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def trainer() -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2),
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    config = ml.GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=128,
        seq_length=16,
        make_vocab_size_divisible_by=64,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128)
    if sys.argv[1] == "boom":
        trainer().fit(Boom(config, int(sys.argv[2])), data)
    else:
        module = ml.GPTModule(config)
        for fit in range(2):
            t = trainer()
            t.fit(module, data)
            # after fit, in every rank, with the run's process groups: they live until the process exits
            tokens = module.generate([[1, 2, 3]], 4).tokens
            with open(f"rank{t.global_rank}.txt", "a") as f:
                f.write(f"fit {fit} loss {float(t.callback_metrics['train/loss']):.6f} tokens {tokens[0]}\n")
