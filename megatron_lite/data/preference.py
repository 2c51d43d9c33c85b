"""Preference pairs for reward models and DPO: JSONL lines of ``{"prompt", "chosen", "rejected"}``.

Prompt and response are tokenized separately (so the boundary between them is exact) and joined;
an EOD token ends each response (``append_eod``), so a reward model reads its score where the
response ends. A sequence holds at most ``seq_length`` tokens (the response's tail is cut when it
is longer) and is padded to ``seq_length + 1`` like every other datamodule's ``tokens``: the last
column is always padding, so a model can run on ``tokens[:, :-1]`` and still see every real token,
and next-token log-probs (DPO) shift by one with no sequence losing its end. Every item is::

    chosen_tokens, rejected_tokens        LongTensor [seq_length + 1]  (padded)
    chosen_length, rejected_length        LongTensor []  real tokens, prompt included (1..seq_length)
    prompt_length                         LongTensor []  prompt tokens (the same for both responses)
    chosen_loss_mask, rejected_loss_mask  FloatTensor [seq_length]  1 where predicting token j+1
                                          predicts a response token (response-only log-probs)
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.jsonl import open_text, parse_object_line

FIELDS = ("prompt", "chosen", "rejected")


def read_preferences(path: str, keys: Sequence[str] = FIELDS) -> list[tuple[str, str, str, str]]:
    """``(prompt, chosen, rejected, "file:line")`` of every non-blank line of a JSONL(.gz) file; ``keys``
    names the prompt, chosen and rejected fields. One-line ValueErrors name the line and the fix."""
    pairs = []
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            obj = parse_object_line(line, where, keys[0], what="a preference file")
            if obj is None:
                continue
            missing = [k for k in keys if not isinstance(obj.get(k), str)]
            if missing:
                raise ValueError(f"{where} lacks string field(s) {missing} (found {sorted(obj)}); every line needs "
                                 f"{{{', '.join(repr(k) + ': str' for k in keys)}}}")
            pairs.append((obj[keys[0]], obj[keys[1]], obj[keys[2]], where))
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs; write one JSON object per line with fields {list(keys)}")
    return pairs


class PreferenceDataset(Dataset):
    """Tokenized preference pairs (see the module docstring for the items)."""

    def __init__(self, pairs: Sequence[tuple[str, str, str, str]], tokenizer: Tokenizer, seq_length: int,
                 append_eod: bool = True):
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        self.seq_length = seq_length
        self.pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
        self.num_truncated = 0
        """Responses whose tail was cut to fit ``seq_length``."""
        self.samples = []
        for prompt, chosen, rejected, where in pairs:
            prompt_ids = tokenizer.tokenize(prompt)
            sample = {}
            for name, text in (("chosen", chosen), ("rejected", rejected)):
                response = tokenizer.tokenize(text) + ([tokenizer.eod] if append_eod else [])
                if not response:
                    raise ValueError(f"{where}: the {name} response is empty (no tokens); remove the pair or keep "
                                     f"append_eod=True so every response ends in EOD")
                if len(prompt_ids) >= seq_length:
                    raise ValueError(f"{where}: the prompt's {len(prompt_ids)} tokens fill seq_length={seq_length}, "
                                     f"leaving nothing of the {name} response; raise seq_length or shorten the prompt")
                ids = (prompt_ids + response)[:seq_length]
                self.num_truncated += len(prompt_ids) + len(response) > seq_length
                tokens = np.full(seq_length + 1, self.pad, dtype=np.int64)
                tokens[:len(ids)] = ids
                mask = np.zeros(seq_length, dtype=np.float32)
                mask[len(prompt_ids) - 1 if prompt_ids else 0:len(ids) - 1] = 1.0
                sample[f"{name}_tokens"] = torch.from_numpy(tokens)
                sample[f"{name}_length"] = torch.tensor(len(ids))
                sample[f"{name}_loss_mask"] = torch.from_numpy(mask)
            sample["prompt_length"] = torch.tensor(len(prompt_ids))
            self.samples.append(sample)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


class PreferenceDataModule(PretrainingDataModule):
    """Preference pairs from JSONL file(s), split by pair (``split``, Megatron's weights) after a seeded
    shuffle. One sample is one pair; ``micro_batch_size`` and ``global_batch_size`` count pairs, and a
    batch is one optimizer step's pairs for this data-parallel rank (split into microbatches by the module).
    """

    def __init__(self, path: Union[str, Sequence[str]], tokenizer: Tokenizer, seq_length: int = 512,
                 micro_batch_size: int = 4, global_batch_size: int = 16, split: str = "98,2", append_eod: bool = True,
                 prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected",
                 seed: int = 1234, num_workers: int = 0, rampup_batch_size: Optional[list[int]] = None) -> None:
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        self.paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not self.paths:
            raise ValueError("PreferenceDataModule needs at least one path (a .jsonl or .jsonl.gz file)")
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"preference data {p} does not exist; pass data.path=<a .jsonl(.gz) file of "
                                        f"{{\"{prompt_key}\": ..., \"{chosen_key}\": ..., \"{rejected_key}\": ...}} lines>")
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a megatron_lite Tokenizer (see build_tokenizer), got "
                            f"{type(tokenizer).__name__}")
        self.tokenizer, self.split, self.append_eod, self.seed = tokenizer, parse_split(split), append_eod, seed
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.vocab_size = tokenizer.vocab_size
        self.datasets: dict[str, PreferenceDataset] = {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.datasets:
            return
        pairs = [pair for p in self.paths for pair in read_preferences(p, self.keys)]
        order = np.random.RandomState(self.seed).permutation(len(pairs))
        bounds = split_boundaries(self.split, len(pairs))
        for name, lo, hi in zip(("train", "validation", "test"), bounds[:-1], bounds[1:]):
            if hi > lo:
                self.datasets[name] = PreferenceDataset([pairs[i] for i in order[lo:hi]], self.tokenizer,
                                                        self.seq_length, self.append_eod)

    def _split(self, name: str) -> PreferenceDataset:
        self.setup()
        if name not in self.datasets:
            raise ValueError(f"the {name} split of {self.paths} is empty; give it a weight in split (e.g. '90,10')")
        return self.datasets[name]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("train"), "train", self._consumed_at_start())

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("validation"), "validation")

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._split("test"), "test")

    def _too_small_hint(self, split: str) -> str:
        return f"add preference pairs to {self.paths}, raise the {split} weight in split, or lower global_batch_size"
