"""Mock GPT data (like Megatron's ``--mock-data``): random tokens, deterministic per sample."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.data.datamodule import PretrainingDataModule

# steps of mock training data available by default; samples are generated on access, so this is free
_DEFAULT_TRAIN_STEPS = 10_000
# global batches in the default validation set
_DEFAULT_VAL_STEPS = 4
# added to the seed for the validation set; samples are hashed from (seed, index), so any offset works
_VAL_SEED_OFFSET = 1


class MockGPTDataset(Dataset):
    """Map-style dataset of ``num_samples`` random token sequences of ``seq_length + 1`` tokens.

    Sample ``i`` depends only on ``(seed, i)`` -- never on the rank, the process or the access order -- so
    every data-parallel layout sees the same global data.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        """Validate sizes; nothing is generated until a sample is read."""
        for name, value, minimum in (
            ("num_samples", num_samples, 1),
            ("seq_length", seq_length, 1),
            ("vocab_size", vocab_size, 2),
            ("seed", seed, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; set {name}=<int>")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        """Number of samples."""
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"tokens": LongTensor[seq_length + 1]}`` for sample ``index``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        # SeedSequence hashes the whole (seed, index) pair; torch's CPU generator keeps only the low
        # 32 bits of its seed, so a linear mix like seed * K + index collides across seeds and indices
        rng = np.random.default_rng([self.seed, int(index)])
        tokens = rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
        return {"tokens": torch.from_numpy(tokens)}


class MockGPTDataModule(PretrainingDataModule):
    """Random-token pretraining data with Megatron's sampler; no files, no tokenizer."""

    def __init__(
        self,
        seq_length: int = 128,
        micro_batch_size: int = 2,
        global_batch_size: int = 8,
        vocab_size: int = 1024,
        seed: int = 1234,
        num_train_samples: int | None = None,
        num_val_samples: int | None = None,
        num_workers: int = 0,
        rampup_batch_size: list[int] | None = None,
    ) -> None:
        """Validate everything here so a bad config fails before processes are spawned.

        ``num_train_samples`` defaults to 10,000 global batches and ``num_val_samples`` to 4.
        ``rampup_batch_size`` ramps the training batch up (see :class:`PretrainingDataModule`).
        """
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}; set vocab_size=<int >= 2>")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if num_train_samples is None:
            num_train_samples = _DEFAULT_TRAIN_STEPS * global_batch_size
        if num_val_samples is None:
            num_val_samples = _DEFAULT_VAL_STEPS * global_batch_size
        for name, value in (("num_train_samples", num_train_samples), ("num_val_samples", num_val_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < global_batch_size:
                raise ValueError(
                    f"{name} must be an integer >= global_batch_size ({global_batch_size}), got {value!r}; "
                    f"set {name} to at least one global batch or leave it unset"
                )
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.tokenizer = None
        # "seed" is left out: Lightning refuses to log hparams when the module saves a different "seed".
        self.save_hyperparameters(ignore=["seed"])
        self.train_dataset = MockGPTDataset(num_train_samples, seq_length, vocab_size, seed)
        self.val_dataset = MockGPTDataset(num_val_samples, seq_length, vocab_size, seed + _VAL_SEED_OFFSET)

    def train_dataloader(self) -> DataLoader:
        """Train batches for this DP rank, continuing from the consumed samples of a resumed run."""
        return self._loader(self.train_dataset, "train", self._consumed_at_start())

    def val_dataloader(self) -> DataLoader:
        """Validation batches for this DP rank, always from the start of the validation set."""
        return self._loader(self.val_dataset, "validation")

    def _too_small_hint(self, split: str) -> str:
        """Mock data can always be made larger."""
        return f"raise num_{'val' if split == 'validation' else 'train'}_samples or leave it unset"
