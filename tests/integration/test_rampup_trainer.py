"""Batch-size ramp-up in a real Trainer: GPTModule under MegatronStrategy (two forked DP ranks) runs, per step,
the number of microbatches Megatron's formula gives for the samples consumed, on the sequential data, across
an epoch boundary and through a checkpoint resume mid-ramp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule

SEQ, VOCAB, MBS, GBS, DP = 16, 256, 2, 16, 2
RAMP = [4, 4, 48]  # 4, 8, 12 then 16 samples per step; one microbatch per rank at the start, four at the end
TRAIN_SAMPLES = 64  # one pass: steps of 4, 4, 4, 4, 8, 8, 12, 12 (56 samples; 56 + 16 > 64), then 16 each
STEPS = 11


def megatron_batch_size(consumed: int) -> int:
    """Megatron-LM's ramp-up rule for RAMP and GBS."""
    start, increment, ramp_samples = RAMP
    if consumed > ramp_samples:
        return GBS
    return start + int(consumed / (ramp_samples / ((GBS - start) // increment))) * increment


class MicrobatchCounter(ml.GPTModule):
    """GPTModule that counts the microbatches its schedule runs (the loss is computed once per microbatch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.microbatches = 0

    def loss_fn(self, model: torch.nn.Module, microbatch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        assert microbatch["tokens"].shape[0] == MBS
        self.microbatches += 1
        return super().loss_fn(model, microbatch)


class StepRecorder(L.Callback):
    """Per optimizer step on this rank: the batch, the epoch and the microbatches run; saved at the end."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, {}  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        pl_module.microbatches = 0
        self.steps[trainer.global_step] = {"tokens": batch["tokens"].clone(), "epoch": trainer.current_epoch}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: dict, batch_idx: int) -> None:
        self.steps[trainer.global_step - 1]["microbatches"] = pl_module.microbatches
        self.steps[trainer.global_step - 1]["lr"] = float(trainer.callback_metrics["train/lr"])

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.out / f"rank{trainer.global_rank}.pt")


def _fit(
    out: Path,
    ckpt_path: str | None = None,
    checkpoints: Path | None = None,
    optimizer: ml.OptimizerConfig | None = None,
) -> dict[int, dict]:
    """Train to STEPS under DP 2; return per step the global batch (ranks concatenated), epoch and microbatches."""
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ)
    data = MockGPTDataModule(
        seq_length=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        vocab_size=VOCAB,
        seed=3,
        num_train_samples=TRAIN_SAMPLES,
        rampup_batch_size=RAMP,
    )
    callbacks: list[L.Callback] = [StepRecorder(out)]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=5, save_top_k=-1))
    trainer = L.Trainer(
        strategy="megatron_fork",
        accelerator="cpu",
        devices=DP,
        max_steps=STEPS,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    module = MicrobatchCounter(config, optimizer or ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant"))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(DP)]
    assert all(r.keys() == ranks[0].keys() for r in ranks)
    steps = {}
    for step in ranks[0]:
        assert len({r[step]["microbatches"] for r in ranks}) == 1 and len({r[step]["epoch"] for r in ranks}) == 1
        steps[step] = {
            "tokens": torch.cat([r[step]["tokens"] for r in ranks]),
            "epoch": ranks[0][step]["epoch"],
            "microbatches": ranks[0][step]["microbatches"],
            "lr": ranks[0][step]["lr"],
        }
    return steps


def test_microbatches_follow_the_ramp_and_resume_mid_ramp_is_exact(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpts"
    full = _fit(tmp_path / "full", checkpoints=checkpoints)
    assert sorted(full) == list(range(STEPS))
    dataset = MockGPTDataModule(
        seq_length=SEQ,
        micro_batch_size=MBS,
        global_batch_size=GBS,
        vocab_size=VOCAB,
        seed=3,
        num_train_samples=TRAIN_SAMPLES,
    ).train_dataset
    consumed = offset = 0
    for step in range(STEPS):
        size = megatron_batch_size(consumed)
        assert full[step]["microbatches"] == size // (MBS * DP), step  # what the module ran on each rank
        if offset + size > TRAIN_SAMPLES:  # the pass (Lightning epoch) is over: the next one starts at 0
            offset = 0
        expected = torch.stack([dataset[i]["tokens"] for i in range(offset, offset + size)])
        assert torch.equal(full[step]["tokens"], expected), step
        offset += size
        consumed += size
    assert [full[s]["microbatches"] for s in range(STEPS)] == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert [full[s]["epoch"] for s in range(STEPS)] == [0] * 8 + [1] * 3
    # resumed from the checkpoint after step 5 (24 samples consumed, batches of 8 by then)
    resumed = _fit(tmp_path / "resumed", ckpt_path=str(checkpoints / "epoch=0-step=5.ckpt"))
    assert sorted(resumed) == list(range(5, STEPS))
    for step in resumed:
        assert torch.equal(resumed[step]["tokens"], full[step]["tokens"]), step
        assert (
            resumed[step]["microbatches"] == full[step]["microbatches"]
            and resumed[step]["epoch"] == full[step]["epoch"]
        )


def test_sample_based_lr_schedule_follows_the_consumed_samples_under_ramp_up(tmp_path: Path) -> None:
    """Megatron counts the schedule in samples under ramp-up: the lr of each step is the formula at the
    samples consumed before it (warmup over 12 samples, then cosine to min_lr at 120 samples)."""
    import math

    optimizer = ml.OptimizerConfig(
        lr=1e-3, min_lr=1e-4, lr_warmup_samples=12, lr_decay_samples=120, lr_decay_style="cosine"
    )
    run = _fit(tmp_path, optimizer=optimizer)
    consumed = 0
    for step in range(STEPS):
        if consumed <= 12:
            expected = 1e-3 * consumed / 12
        else:
            ratio = min(1.0, (consumed - 12) / (120 - 12))
            expected = 1e-4 + 0.5 * (math.cos(math.pi * ratio) + 1) * (1e-3 - 1e-4)
        assert math.isclose(run[step]["lr"], expected, rel_tol=1e-6, abs_tol=1e-12), (step, consumed)
        consumed += megatron_batch_size(consumed)
