"""Prompts for batch generation with ``trainer.predict``: :meth:`GPTModule.predict_step` continues
every prompt of a :class:`PromptDataModule` batch and returns its new tokens.

A batch is ``{"prompt_tokens": [b, L] (each row's prompt, then zeros), "prompt_lengths": [b],
"index": [b] (dataset indices), "generation": {options}}``. The dataset indices seed each prompt's
sampling generator, so a prompt's sampled tokens depend on the seed and the prompt alone, not on the
batch size or the number of data-parallel replicas.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.inference.generate import model_context
from megatron_lite.core.inference.prompts import check_prompts, check_stop_ids
from megatron_lite.core.inference.sampling import SamplingParams
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.tokenizers.base import Tokenizer

Prompt = Union[str, Sequence[int]]


class PromptDataset(Dataset):
    """Token-id prompts; item ``i`` is ``{"prompt": LongTensor[len], "index": i}``."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        self.prompts = [torch.tensor(list(p), dtype=torch.int64) for p in prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"prompt": self.prompts[index], "index": index}


class PromptDataModule(pl.LightningDataModule):
    """Prompts and how to continue them, for ``trainer.predict(module, datamodule=...)``.

    ``prompts`` are token-id lists, or texts with a ``tokenizer``. ``trainer.predict`` returns, per batch,
    the new tokens [batch, max_new_tokens] (int64; -1 after a row stopped on one of ``stop_ids``). The
    options are checked here, and the prompts against the model (vocabulary, context) before any process
    is launched.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        batch_size: int = 8,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop_ids: Optional[Sequence[int]] = None,
        tokenizer: Optional[Tokenizer] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts; wrap a single prompt in a list: [prompt]")
        prompts = list(prompts)
        if any(isinstance(p, str) for p in prompts):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer=... (or token-id lists)")
            prompts = [tokenizer.tokenize(p) if isinstance(p, str) else p for p in prompts]
        # Everything but the model's vocabulary and context, which check_fits_model checks (before launch too).
        self.prompts = check_prompts(prompts, max_new_tokens, vocab_size=None, context=None)
        self.stop_ids = check_stop_ids(stop_ids, vocab_size=None)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.tokenizer = tokenizer
        self.dataset = PromptDataset(self.prompts)

    def check_fits_model(self, config: Any) -> None:
        """Raise a ValueError naming the fix if a prompt or stop id does not fit the model ``config``
        (a GPTConfig): ids outside its vocabulary, a prompt plus max_new_tokens past its context."""
        check_prompts(self.prompts, self.max_new_tokens, config.vocab_size, model_context(config))
        check_stop_ids(self.stop_ids, config.vocab_size)

    def check_before_launch(self, run: RunSpec, trainer: Any, module: Any, datamodule: Any) -> None:
        """MegatronStrategy's pre-launch check: the prompts against the module's model (a GPTConfig ``config``)."""
        config = getattr(module, "config", None)
        if isinstance(config, GPTConfig):
            self.check_fits_model(config)

    def generation_options(self) -> dict[str, Any]:
        """What each batch carries to :meth:`GPTModule.generate_batch`."""
        s = self.sampling
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "seed": s.seed,
            "stop_ids": list(self.stop_ids),
        }

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Prompts of one batch, left-aligned and zero-filled to the longest."""
        return {**pad_prompts(samples), "generation": self.generation_options()}

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )


def pad_prompts(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``prompt_tokens`` [b, longest] (each sample's ``prompt`` left-aligned, zero-filled), ``prompt_lengths`` [b]
    and the samples' dataset ``index`` [b]: the prompt part of a generation or rollout batch."""
    lengths = torch.tensor([len(s["prompt"]) for s in samples], dtype=torch.int64)
    tokens = torch.zeros(len(samples), int(lengths.max()), dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample["prompt"])] = sample["prompt"]
    return {
        "prompt_tokens": tokens,
        "prompt_lengths": lengths,
        "index": torch.tensor([s["index"] for s in samples], dtype=torch.int64),
    }
