"""GPTModule through a real Trainer computes exactly what a hand-written PyTorch loop computes.

This anchors every parity test: the single-process reference they compare against is itself
equal to the obvious loop (mean next-token loss over the global batch, gradient accumulation
over microbatches, global-norm clipping, AdamW, Megatron's warmup + cosine LR).
"""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import megatron_lite as ml
from megatron_lite.core.optim import MegatronLRScheduler, build_optimizer
from megatron_lite.data import MockGPTDataModule, MockGPTDataset

CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=200,
    seq_length=16,
    make_vocab_size_divisible_by=8,
)
OPT = dict(lr=2e-3, min_lr=2e-4, lr_warmup_iters=2, lr_decay_iters=6, clip_grad=0.5, weight_decay=0.1)
STEPS, GBS, MBS = 6, 8, 2


def plain_loop_losses() -> list[float]:
    config, opt_cfg = ml.GPTConfig(**CONFIG), ml.OptimizerConfig(**OPT)
    model = ml.GPTModel(config, seed=1234)
    optimizer = build_optimizer(model, opt_cfg)
    scheduler = MegatronLRScheduler(optimizer, opt_cfg, opt_cfg.lr_decay_iters)
    data = DataLoader(MockGPTDataset(STEPS * GBS, config.seq_length, config.vocab_size, seed=7), batch_size=GBS)
    losses = []
    for batch in data:
        optimizer.zero_grad()
        total = 0.0
        for micro in batch["tokens"].split(MBS):
            loss = model(micro[:, :-1], micro[:, 1:]).mean() / (GBS // MBS)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_grad)
        optimizer.step()
        scheduler.step()
        losses.append(total)
    return losses


class Losses(L.Callback):
    """Writes rank 0's per-step losses to a file: with the fork launcher they live in the child."""

    def __init__(self, path):
        self.path, self.values = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.values, self.path)


@pytest.mark.parametrize("strategy", ["auto", "megatron_fork"])
def test_gpt_module_equals_plain_pytorch_loop(strategy, tmp_path):
    losses = Losses(tmp_path / "losses.pt")
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
        limit_val_batches=0,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=MBS, global_batch_size=GBS, vocab_size=200, seed=7)
    trainer.fit(ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(**OPT), seed=1234), data)
    recorded = torch.load(tmp_path / "losses.pt")
    assert len(recorded) == STEPS
    torch.testing.assert_close(torch.tensor(recorded), torch.tensor(plain_loop_losses()), rtol=1e-5, atol=0)
