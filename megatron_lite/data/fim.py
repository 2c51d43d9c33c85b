"""Fill-in-the-middle (FIM) training samples, as Megatron's GPTFIMDataset and the FIM paper.

With probability ``fim_rate`` each document of a sample is cut at two random token positions into
prefix / middle / suffix and rearranged so the model learns to write the middle last:

- PSM: ``<PRE> prefix <SUF> suffix <MID> middle``
- SPM (with probability ``fim_spm_rate``; the paper's variant 2): ``<PRE> <SUF> suffix <MID> prefix middle``

The three sentinel tokens make a sample longer; the suffix is truncated to keep the length (or the
document is left untouched when it is too short to pay for them). Randomness is drawn from
``(seed, sample index)`` alone, so a sample is the same in every run, rank and worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class FIMTokens:
    """Ids of the FIM sentinels."""

    prefix: int
    """``<fim_prefix>`` id."""
    middle: int
    """``<fim_middle>`` id."""
    suffix: int
    """``<fim_suffix>`` id."""
    eod: int
    """End-of-document id: documents inside a sample are permuted separately."""

    @classmethod
    def from_tokenizer(
        cls, tokenizer, prefix: str = "<fim_prefix>", middle: str = "<fim_middle>", suffix: str = "<fim_suffix>"
    ) -> "FIMTokens":
        """Look the sentinels up by text; each must be a single token of ``tokenizer``."""
        ids = []
        for text in (prefix, middle, suffix):
            tokens = tokenizer.tokenize(text)
            if len(tokens) != 1:
                raise ValueError(
                    f"the tokenizer has no single token for {text!r} (it gives {tokens}); add it as a special "
                    f"token, or build FIMTokens(prefix=..., middle=..., suffix=..., eod=...) with explicit ids"
                )
            ids.append(tokens[0])
        return cls(prefix=ids[0], middle=ids[1], suffix=ids[2], eod=tokenizer.eod)


def permute_document(doc: np.ndarray, rng: np.random.RandomState, spm: bool, tokens: FIMTokens) -> np.ndarray:
    """One document rearranged into PSM or SPM order, the same length as ``doc``.

    Too short to hold the three sentinels plus one token each: returned unchanged.
    """
    n = len(doc)
    if n < 4:
        return doc
    lo, hi = sorted(rng.randint(0, n + 1, size=2))
    prefix, middle, suffix = doc[:lo], doc[lo:hi], doc[hi:]
    # The sentinels cost 3 tokens: take them off the suffix, then the middle, so the length holds.
    excess = 3
    cut = min(excess, len(suffix))
    suffix, excess = suffix[: len(suffix) - cut], excess - cut
    if excess:
        cut = min(excess, len(middle))
        middle, excess = middle[: len(middle) - cut], excess - cut
    if excess:
        prefix = prefix[: len(prefix) - excess]
    sentinel = lambda t: np.array([t], dtype=doc.dtype)  # noqa: E731
    if spm:
        parts = [sentinel(tokens.prefix), sentinel(tokens.suffix), suffix, sentinel(tokens.middle), prefix, middle]
    else:
        parts = [sentinel(tokens.prefix), prefix, sentinel(tokens.suffix), suffix, sentinel(tokens.middle), middle]
    out = np.concatenate(parts)
    assert len(out) == n
    return out


def fim_sample(
    sample: np.ndarray, rng: np.random.RandomState, fim_rate: float, fim_spm_rate: float, tokens: FIMTokens
) -> np.ndarray:
    """Apply FIM to each document (split at EOD tokens, which stay in place) of a token window."""
    out = sample.copy()
    boundaries = np.flatnonzero(sample == tokens.eod)
    start = 0
    for end in [*boundaries.tolist(), len(sample)]:
        if end > start and rng.binomial(1, fim_rate):
            spm = bool(rng.binomial(1, fim_spm_rate))
            out[start:end] = permute_document(sample[start:end], rng, spm, tokens)
        start = end + 1
    return out


class FIMDataset(Dataset):
    """Wraps a dataset of ``{"tokens": [seq_length + 1]}`` samples and applies FIM to them."""

    def __init__(
        self, dataset: Dataset, tokens: FIMTokens, fim_rate: float = 0.5, fim_spm_rate: float = 0.5, seed: int = 1234
    ):
        if not 0.0 <= fim_rate <= 1.0:
            raise ValueError(f"fim_rate must be in [0, 1], got {fim_rate}")
        if not 0.0 <= fim_spm_rate <= 1.0:
            raise ValueError(f"fim_spm_rate must be in [0, 1], got {fim_spm_rate}")
        self.dataset, self.tokens = dataset, tokens
        self.fim_rate, self.fim_spm_rate, self.seed = fim_rate, fim_spm_rate, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = dict(self.dataset[index])
        sample = item["tokens"].numpy()
        rng = np.random.RandomState(np.random.SeedSequence([self.seed, index]).generate_state(1)[0])
        item["tokens"] = torch.from_numpy(fim_sample(sample, rng, self.fim_rate, self.fim_spm_rate, self.tokens))
        return item


def fim_dataset_or_plain(
    dataset: Dataset, tokens: Optional[FIMTokens], fim_rate: float, fim_spm_rate: float, seed: int
) -> Dataset:
    """``dataset`` wrapped in FIM when ``fim_rate > 0``."""
    if fim_rate <= 0.0:
        return dataset
    if tokens is None:
        raise ValueError("fim_rate > 0 needs the FIM sentinel ids (FIMTokens)")
    return FIMDataset(dataset, tokens, fim_rate, fim_spm_rate, seed)
