"""Data side: batch geometry, Megatron's pretraining sampler, mock and JSONL-corpus datamodules.

Every train/val dataloader yields ``{"tokens": LongTensor[global_batch_size // dp, seq_length + 1]}``:
one optimizer step's worth of samples for this data-parallel rank.
"""

from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.bundled import bundled_corpora, bundled_corpus, resolve_corpus
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.fim import FIMDataset, FIMTokens
from megatron_lite.data.geometry import DataGeometry
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
