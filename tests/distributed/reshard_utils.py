"""Callbacks that record what the resharding and resume tests compare, from inside the forked ranks:
the loss of a fixed batch (the model as loaded, before any step), the sample indices each rank trained
on, and the RNG states at a save and right after a load."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import lightning as L
import torch

from megatron_lite.data.mock import MockGPTDataset

FIXED_BATCH_SEED = 99  # another seed than the training data's: a batch no run trains on


def fixed_batch(num_samples: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """``num_samples`` token rows [n, seq_length + 1] that depend only on the sizes."""
    data = MockGPTDataset(num_samples, seq_length, vocab_size, FIXED_BATCH_SEED)
    return torch.stack([data[i]["tokens"] for i in range(num_samples)])


class FixedBatchLoss(L.Callback):
    """The global loss of one fixed global batch, forward only: right after a checkpoint was loaded
    (``at_step=None``: when training starts) or after optimizer step ``at_step`` (where a checkpoint is
    saved). Written by global rank 0 as ``fixed_loss.pt``; each DP rank feeds its slice."""

    def __init__(self, out: Path, at_step: Optional[int] = None):
        self.out, self.at_step = Path(out), at_step

    def _measure(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        tokens = fixed_batch(dm.global_batch_size, dm.seq_length, pl_module.config.vocab_size)
        layout = pl_module.parallel_layout
        local = dm.global_batch_size // layout.dp_size
        batch = {"tokens": tokens[layout.dp_rank * local : (layout.dp_rank + 1) * local]}
        with torch.no_grad():
            loss = float(pl_module.run_schedule(batch, forward_only=True).loss)
        if trainer.global_rank == 0:
            torch.save({"loss": loss, "step": trainer.global_step}, self.out / "fixed_loss.pt")

    def on_train_start(self, trainer, pl_module):
        if self.at_step is None:
            self._measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at_step is not None and trainer.global_step == self.at_step:
            self._measure(trainer, pl_module)


class SampleRecorder(L.Callback):
    """Every rank's training tokens per step, as ``samples_rank<r>.pt`` (a list of [b, s+1] tensors)."""

    def __init__(self, out: Path):
        self.out, self.batches = Path(out), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["tokens"].detach().cpu().clone())

    def on_train_end(self, trainer, pl_module):
        layout = pl_module.parallel_layout
        torch.save(
            {"batches": self.batches, "dp_rank": layout.dp_rank, "dp_size": layout.dp_size},
            self.out / f"samples_rank{trainer.global_rank}.pt",
        )


def sample_indices(out: Path, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Per step, the sorted indices of the mock dataset's samples that the ranks of a run trained on
    (from :class:`SampleRecorder`'s files; the replicas of one DP rank must agree)."""
    data = MockGPTDataset(num_samples, seq_length, vocab_size, seed)
    index = {tuple(data[i]["tokens"].tolist()): i for i in range(num_samples)}
    per_dp: dict[int, list[list[int]]] = {}
    for path in sorted(Path(out).glob("samples_rank*.pt")):
        record = torch.load(path, weights_only=True)
        steps = [[index[tuple(row.tolist())] for row in batch] for batch in record["batches"]]
        if record["dp_rank"] in per_dp:
            assert per_dp[record["dp_rank"]] == steps, f"replicas of DP rank {record['dp_rank']} read other samples"
        per_dp[record["dp_rank"]] = steps
    steps = len(next(iter(per_dp.values())))
    return [sorted(i for rank in per_dp.values() for i in rank[step]) for step in range(steps)]


def rng_snapshot(pl_module) -> dict[str, torch.Tensor]:
    """The global CPU generator's state and every dropout stream of the model."""
    snapshot = {"torch": torch.get_rng_state()}
    for (stream, device), state in pl_module.model.rng_tracker.states.items():
        snapshot[f"{stream}@{device}"] = state.clone()
    return snapshot


class RNGRecorder(L.Callback):
    """Every rank's RNG states when a checkpoint is saved (``rng_saved_step<k>_rank<r>.pt``), when training
    starts (``rng_start_rank<r>.pt``: after a load, the dropout streams it restored or re-derived; the global
    CPU generator is set only before the first step) and when it ends (``rng_end_rank<r>.pt``)."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def on_train_start(self, trainer, pl_module):
        torch.save(rng_snapshot(pl_module), self.out / f"rng_start_rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module):
        torch.save(rng_snapshot(pl_module), self.out / f"rng_end_rank{trainer.global_rank}.pt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        torch.save(
            rng_snapshot(pl_module), self.out / f"rng_saved_step{trainer.global_step}_rank{trainer.global_rank}.pt"
        )
