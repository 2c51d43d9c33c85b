"""Data side: batch geometry, Megatron's pretraining sampler, mock and JSONL-corpus datamodules.

Every train/val dataloader yields ``{"tokens": LongTensor[global_batch_size // dp, seq_length + 1]}``:
one optimizer step's worth of samples for this data-parallel rank.

Every name below is imported on first use (``from megatron_lite.data import MockGPTDataModule``,
``megatron_lite.data.IndexedDataset``): the datamodules import Lightning, which preprocessing and the indexed
datasets do not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_lite.core.parallel.geometry import DataGeometry
    from megatron_lite.data.blended import BlendedDataset
    from megatron_lite.data.bundled import bundled_corpora, bundled_corpus, resolve_corpus
    from megatron_lite.data.datamodule import PretrainingDataModule
    from megatron_lite.data.fim import FIMDataset, FIMTokens
    from megatron_lite.data.gpt_dataset import GPTDataset
    from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron_lite.data.mock import MockGPTDataModule, MockGPTDataset
    from megatron_lite.data.preference import PreferenceDataModule, PreferenceDataset
    from megatron_lite.data.pretrain import PretrainDataModule, parse_data_path
    from megatron_lite.data.prompts import PromptDataModule, PromptDataset
    from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
    from megatron_lite.data.rl_prompts import RLPromptDataModule, RLPromptDataset
    from megatron_lite.data.samplers import MegatronPretrainingSampler
    from megatron_lite.data.sft import SFTDataModule, SFTDataset
    from megatron_lite.data.text_corpus import TextCorpusDataModule, TokenWindowDataset

_PUBLIC = {
    "BlendedDataset": "megatron_lite.data.blended",
    "DataGeometry": "megatron_lite.core.parallel.geometry",
    "FIMDataset": "megatron_lite.data.fim",
    "FIMTokens": "megatron_lite.data.fim",
    "GPTDataset": "megatron_lite.data.gpt_dataset",
    "IndexedDataset": "megatron_lite.data.indexed_dataset",
    "IndexedDatasetBuilder": "megatron_lite.data.indexed_dataset",
    "MegatronPretrainingRandomSampler": "megatron_lite.data.random_sampler",
    "MegatronPretrainingSampler": "megatron_lite.data.samplers",
    "MockGPTDataModule": "megatron_lite.data.mock",
    "MockGPTDataset": "megatron_lite.data.mock",
    "PreferenceDataModule": "megatron_lite.data.preference",
    "PreferenceDataset": "megatron_lite.data.preference",
    "PretrainDataModule": "megatron_lite.data.pretrain",
    "PretrainingDataModule": "megatron_lite.data.datamodule",
    "PromptDataModule": "megatron_lite.data.prompts",
    "PromptDataset": "megatron_lite.data.prompts",
    "RLPromptDataModule": "megatron_lite.data.rl_prompts",
    "RLPromptDataset": "megatron_lite.data.rl_prompts",
    "SFTDataModule": "megatron_lite.data.sft",
    "SFTDataset": "megatron_lite.data.sft",
    "TextCorpusDataModule": "megatron_lite.data.text_corpus",
    "TokenWindowDataset": "megatron_lite.data.text_corpus",
    "bundled_corpora": "megatron_lite.data.bundled",
    "bundled_corpus": "megatron_lite.data.bundled",
    "parse_data_path": "megatron_lite.data.pretrain",
    "resolve_corpus": "megatron_lite.data.bundled",
}
"""Public name -> the module that defines it."""
__all__ = [
    "BlendedDataset",
    "DataGeometry",
    "FIMDataset",
    "FIMTokens",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingRandomSampler",
    "PreferenceDataModule",
    "PreferenceDataset",
    "MegatronPretrainingSampler",
    "MockGPTDataModule",
    "MockGPTDataset",
    "PretrainDataModule",
    "PretrainingDataModule",
    "PromptDataModule",
    "PromptDataset",
    "RLPromptDataModule",
    "RLPromptDataset",
    "SFTDataModule",
    "SFTDataset",
    "TextCorpusDataModule",
    "TokenWindowDataset",
    "bundled_corpora",
    "bundled_corpus",
    "parse_data_path",
    "resolve_corpus",
]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (and then bound here)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The names bound so far and the lazy ones, for tab completion (and a "did you mean")."""
    return sorted({*globals(), *_PUBLIC})
