"""Evaluation splits padded to whole global batches, the padding masked out of the loss.

A training pass may skip the trailing partial global batch (the next pass covers it); an evaluation pass must
not, or ``val/loss`` depends on the batch size. So the last global batch of an evaluation split is filled up
with samples whose ``loss_mask`` is all 0: they run through the model like any sample (every DP rank still
gets whole microbatches) but add neither loss nor tokens to the token-weighted mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from megatron_lite.data.read_ahead import prefetch_samples

TOKEN_SAMPLE_KEYS = frozenset({"tokens", "loss_mask", "position_ids", "cu_seqlens"})
"""What a GPT token sample may hold (see GPTModule's loss); the padding of anything else is not known here."""


def masked_padding_sample(sample: Any) -> Optional[dict[str, torch.Tensor]]:
    """A copy of the token sample ``sample`` whose every token is left out of the loss (``loss_mask`` all 0), or
    None when ``sample`` holds more than a GPT token sample (its loss may not read ``loss_mask``)."""
    if not isinstance(sample, dict) or "tokens" not in sample or not set(sample) <= TOKEN_SAMPLE_KEYS:
        return None
    tokens = sample["tokens"]
    mask = sample.get("loss_mask")
    zeros = torch.zeros_like(mask) if mask is not None else torch.zeros(tokens.shape[-1] - 1, dtype=torch.float32)
    return {**sample, "loss_mask": zeros}


class PaddedEvaluationDataset(Dataset):
    """``dataset`` followed by copies of ``padding`` up to ``length`` samples.

    When the padding carries a ``loss_mask`` and the real samples do not, theirs is added (all 1: every token
    counts, as without one), so that real and padding samples collate into one batch.
    """

    def __init__(self, dataset: Dataset, length: int, padding: dict[str, torch.Tensor]) -> None:
        """``length`` >= ``len(dataset)``: the padded size (a whole number of global batches)."""
        self.dataset = dataset
        self.real_samples = len(dataset)  # type: ignore[arg-type]
        """Samples of the split itself; indices from here on are padding."""
        if length < self.real_samples:
            raise ValueError(f"the padded length ({length}) is shorter than the dataset ({self.real_samples})")
        self.length = length
        self.padding = padding

    def __len__(self) -> int:
        """The padded length."""
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index`` of the split, or the padding sample past its end."""
        if not 0 <= index < self.length:
            raise IndexError(f"sample index {index} out of range for {self.length} samples")
        if index >= self.real_samples:
            return self.padding
        sample = self.dataset[index]
        if "loss_mask" not in sample:
            sample = {**sample, "loss_mask": torch.ones_like(self.padding["loss_mask"])}
        return sample

    def prefetch_samples(self, indices: Sequence[int]) -> None:
        """Start reading the split's samples among ``indices`` ahead (the padding is never read)."""
        prefetch_samples(self.dataset, [i for i in indices if i < self.real_samples])
