"""Data side: batch geometry, Megatron's pretraining sampler, mock and JSONL-corpus datamodules.

Every train/val dataloader yields ``{"tokens": LongTensor[global_batch_size // dp, seq_length + 1]}``:
one optimizer step's worth of samples for this data-parallel rank.
"""

from pathlib import Path

from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.fim import FIMDataset, FIMTokens
from megatron_lite.data.geometry import DataGeometry
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_lite.data.mock import MockGPTDataModule, MockGPTDataset
from megatron_lite.data.preference import PreferenceDataModule, PreferenceDataset
from megatron_lite.data.pretrain import PretrainDataModule, parse_data_path
from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
from megatron_lite.data.samplers import MegatronPretrainingSampler
from megatron_lite.data.sft import SFTDataModule, SFTDataset
from megatron_lite.data.text_corpus import TextCorpusDataModule, TokenWindowDataset

_CORPORA_DIR = Path(__file__).resolve().parent / "corpora"


def bundled_corpus(name: str = "shakespeare") -> str:
    """Path of a corpus shipped with the package (``"shakespeare"``: 42 works, public domain)."""
    path = _CORPORA_DIR / f"{name}.jsonl.gz"
    if not path.is_file():
        available = sorted(p.name.removesuffix(".jsonl.gz") for p in _CORPORA_DIR.glob("*.jsonl.gz"))
        raise FileNotFoundError(f"no bundled corpus {name!r}; available: {available}")
    return str(path)


__all__ = [
    "BlendedDataset",
    "DataGeometry",
    "FIMDataset",
    "FIMTokens",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "MockGPTDataModule",
    "MockGPTDataset",
    "PretrainDataModule",
    "PretrainingDataModule",
    "SFTDataModule",
    "SFTDataset",
    "TextCorpusDataModule",
    "TokenWindowDataset",
    "bundled_corpus",
    "parse_data_path",
]
