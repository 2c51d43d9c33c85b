"""Prompts (with reference answers) for GRPO: JSONL lines ``{"prompt": ..., "answer": ...}`` or Python rows.

One sample is one prompt; ``global_batch_size`` prompts make one rollout (each sampled ``group_size`` times
by :class:`~megatron_lite.rl.GRPOModule`), ``micro_batch_size`` prompts (times the group size) one
microbatch of the update. A training batch is this data-parallel rank's prompts::

    prompt_tokens   LongTensor [b, L]  each row's prompt, then zeros
    prompt_lengths  LongTensor [b]
    index           LongTensor [b]     the prompt's index in its split: seeds its samples
    answer          list[str]          the rows' answers ("" when a row has none)

The train order is reshuffled every pass from ``seed`` and resumes exactly from ``consumed_samples``
(the module updates ``updates_per_batch`` times per rollout: the position counts rollouts, not optimizer steps).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.object_staging import local_input
from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator
from megatron_lite.data.datamodule import PretrainingDataModule, ResumableDataLoader
from megatron_lite.data.prompts import pad_prompts
from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
from megatron_lite.data.samplers import GlobalBatchSampler, MegatronPretrainingSampler
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.jsonl import parse_object_line, read_lines
from megatron_lite.utils.local_path import require_local_or_object_path


def read_prompt_rows(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict[str, str]]:
    """``{"prompt", "answer"}`` of every non-blank line of a JSONL(.gz) file (the answer may be absent)."""
    rows = []
    for line_no, line in read_lines(path):
        where = f"{path}:{line_no}"
        obj = parse_object_line(line, where, prompt_key, what="a prompt file")
        if obj is None:
            continue
        if not isinstance(obj.get(prompt_key), str):
            raise ValueError(
                f"{where} lacks a string field {prompt_key!r} (found {sorted(obj)}); every line needs "
                f"{{{prompt_key!r}: str, {answer_key!r}: str (optional)}}"
            )
        answer = obj.get(answer_key)
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {type(answer).__name__}")
        rows.append({"prompt": obj[prompt_key], "answer": None if answer is None else str(answer)})
    if not rows:
        raise ValueError(f"{path} holds no prompts; write one JSON object per line with a {prompt_key!r} field")
    return rows


class RLPromptDataset(Dataset):
    """Tokenized prompts; item ``i`` is ``{"prompt": LongTensor[len], "index": i, "answer": str}``."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Tokenizer) -> None:
        self.rows = []
        for number, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(
                    f"prompt row {number} must be a dict with a string 'prompt' (and an 'answer'), got {row!r}"
                )
            ids = tokenizer.tokenize(row["prompt"])
            if not ids:
                raise ValueError(f"prompt row {number} ({row['prompt']!r}) has no tokens; a prompt needs at least one")
            answer = row.get("answer")
            self.rows.append((torch.tensor(ids, dtype=torch.int64), "" if answer is None else str(answer)))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids, answer = self.rows[index]
        return {"prompt": ids, "index": index, "answer": answer}

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt."""
        return max(len(ids) for ids, _ in self.rows)


def collate_prompts(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompts of one batch, left-aligned and zero-filled to the longest (see the module docstring)."""
    return {**pad_prompts(samples), "answer": [s["answer"] for s in samples]}


class RLPromptDataModule(PretrainingDataModule):
    """Prompts for GRPO from ``rows`` (dicts with ``prompt`` and ``answer``) or ``path`` (JSONL), split by
    ``split`` (Megatron's weights; the validation split gives pass@k) or given separately as ``val_rows``.

    ``seq_length`` bounds prompt + response tokens (the module checks ``longest prompt + max_new_tokens``
    against it before launch); ``global_batch_size`` counts prompts per rollout.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        rows: Optional[Sequence[dict[str, Any]]] = None,
        path: Optional[str] = None,
        val_rows: Optional[Sequence[dict[str, Any]]] = None,
        seq_length: int = 64,
        micro_batch_size: int = 1,
        global_batch_size: int = 8,
        val_global_batch_size: Optional[int] = None,
        split: str = "100,0",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a megatron_lite Tokenizer (see build_tokenizer), got {type(tokenizer).__name__}"
            )
        if (rows is None) == (path is None):
            raise ValueError(
                "give the prompts as rows=[{'prompt': ..., 'answer': ...}, ...] or path=<a .jsonl file>, "
                "exactly one of them"
            )
        require_local_or_object_path(path, "path")
        path = None if path is None else local_input(path)  # an s3:// object: a local copy, once per ETag
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(
                f"prompt data {path} does not exist; pass path=<a .jsonl(.gz) file of "
                f'{{"{prompt_key}": ..., "{answer_key}": ...}} lines>'
            )
        self.tokenizer, self.path, self.seed = tokenizer, path, seed
        self.keys = (prompt_key, answer_key)
        self.split = parse_split(split)
        self.vocab_size = tokenizer.vocab_size
        self.val_global_batch_size = val_global_batch_size or global_batch_size
        self.updates_per_batch = 1
        """Optimizer steps per rollout batch (set by GRPOModule): how a step count maps to consumed prompts."""
        self._rows = None if rows is None else list(rows)
        self._val_rows = None if val_rows is None else list(val_rows)
        self.datasets: dict[str, RLPromptDataset] = {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.datasets:
            return
        rows = self._rows if self._rows is not None else read_prompt_rows(self.path, *self.keys)
        if self._val_rows is not None:
            self.datasets["train"] = RLPromptDataset(rows, self.tokenizer)
            if self._val_rows:
                self.datasets["validation"] = RLPromptDataset(self._val_rows, self.tokenizer)
            return
        order = np.random.RandomState(self.seed).permutation(len(rows))
        bounds = split_boundaries(self.split, len(rows))
        for name, lo, hi in zip(("train", "validation", "test"), bounds[:-1], bounds[1:]):
            if hi > lo:
                self.datasets[name] = RLPromptDataset([rows[i] for i in order[lo:hi]], self.tokenizer)

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt of any split."""
        self.setup()
        return max(d.longest_prompt for d in self.datasets.values())

    def _split(self, name: str) -> RLPromptDataset:
        self.setup()
        if name not in self.datasets:
            raise ValueError(
                f"the {name} prompt split is empty; give it a weight in split (e.g. '90,10') or pass val_rows"
            )
        return self.datasets[name]

    def consumed_samples_after(self, steps: int) -> int:
        """Prompts consumed after ``steps`` optimizer steps: one global batch per ``updates_per_batch`` steps."""
        return (steps // self.updates_per_batch) * self.global_batch_size

    def train_dataloader(self) -> DataLoader:
        return self._with_collate(self._loader(self._split("train"), "train", self._consumed_at_start()))

    def val_dataloader(self) -> DataLoader:
        """Held-out prompts, ``val_global_batch_size`` per step over all DP ranks, from the start every time."""
        dataset = self._split("validation")
        dp_size, rank = self._dp_size_and_rank()
        size = min(self.val_global_batch_size, len(dataset) - len(dataset) % dp_size)
        if size < dp_size:
            raise ValueError(
                f"the validation split has {len(dataset)} prompts, fewer than the {dp_size} data-parallel "
                f"ranks; add held-out prompts"
            )
        size -= size % dp_size
        sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=0,
            global_batch_size=size,
            num_replicas=dp_size,
            rank=rank,
            rewind=True,
        )
        return ResumableDataLoader(
            dataset,
            batch_size=size // dp_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_prompts,
            num_workers=self.num_workers,
        )

    def _with_collate(self, loader: DataLoader) -> DataLoader:
        loader.collate_fn = collate_prompts
        return loader

    def _make_sampler(
        self,
        total_samples: int,
        consumed_samples: int,
        dp_size: int,
        rank: int,
        split: str,
        calculator: Optional[NumMicroBatchesCalculator] = None,
    ) -> GlobalBatchSampler:
        if split != "train":
            return super()._make_sampler(total_samples, consumed_samples, dp_size, rank, split, calculator)
        # Reshuffled every pass; one permutation cut into global batches, so the order does not depend on dp.
        return MegatronPretrainingRandomSampler(
            total_samples, consumed_samples, self.global_batch_size, dp_size, rank, seed=self.seed, data_sharding=False
        )

    def _too_small_hint(self, split: str) -> str:
        return "add prompts, raise the split's weight, or lower global_batch_size"
