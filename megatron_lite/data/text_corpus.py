"""Pretraining on a JSONL text corpus: trains (or loads) a SentencePiece tokenizer, caches token arrays."""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.object_staging import local_input
from megatron_lite.core.object_store import is_remote
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data.bundled import resolve_corpus
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers import SentencePieceTokenizer, train_sentencepiece
from megatron_lite.tokenizers.sentencepiece_tokenizer import MIN_BYTE_FALLBACK_VOCAB
from megatron_lite.utils.files import locked, write_atomic
from megatron_lite.utils.jsonl import iter_jsonl_texts
from megatron_lite.utils.local_path import require_local_or_object_path, require_local_path
from megatron_lite.utils.optional import require

# bump when the tokenizer settings or the array layout change, so old caches are not reused
_CACHE_VERSION = "1"
_SPLIT_NAMES = ("train", "validation", "test")
# documents tokenized per native SentencePiece call: bounds memory without per-call overhead
_TOKENIZE_CHUNK = 256
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


class TokenWindowDataset(Dataset):
    """Sample ``j`` is ``tokens[j*s : j*s + s + 1]``: windows overlap by one token and cross documents."""

    def __init__(self, tokens: np.ndarray, seq_length: int) -> None:
        """``tokens`` is the flat token array of one split (may be memory-mapped)."""
        self.tokens = tokens
        self.seq_length = seq_length
        self.num_samples = max(0, (len(tokens) - 1) // seq_length)

    def __len__(self) -> int:
        """Number of full windows."""
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"tokens": LongTensor[seq_length + 1]}``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        start = index * self.seq_length
        window = np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)
        return {"tokens": torch.from_numpy(window)}


def _iter_documents(path: str, json_key: str) -> Iterator[str]:
    """Non-empty texts under ``json_key``, one per JSON line; malformed lines raise ValueError with the line."""
    return iter_jsonl_texts(path, json_key, option="data.json_key")


def _check_corpus(path: str, json_key: str) -> None:
    """Cheap up-front check: the file exists and some line holds non-empty text under ``json_key``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus {path} does not exist; pass data.path=<a .jsonl or .jsonl.gz file>")
    for _ in _iter_documents(path, json_key):
        return
    raise ValueError(
        f"corpus {path} holds no non-empty text under key {json_key!r}; pass a corpus with text, "
        f"or the json_key its objects use"
    )


def _default_cache_dir(path: str) -> str:
    """Next to the corpus if that directory is writable (and not inside this package), else the user cache."""
    corpus_dir = Path(path).resolve().parent
    if os.access(corpus_dir, os.W_OK) and _PACKAGE_DIR not in (corpus_dir, *corpus_dir.parents):
        return str(corpus_dir / ".megatron_lite_cache")
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(user_cache, "megatron_lite")


def _digest(*parts: object) -> str:
    """Short stable hash of ``parts`` for cache file names."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _file_sha256(path: str) -> str:
    """Content hash of a (small) file: identifies a tokenizer model independent of its path."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class TextCorpusDataModule(PretrainingDataModule):
    """GPT pretraining batches from a JSONL corpus (``.gz`` allowed), tokenized once and cached.

    ``path`` is a file, the URL of an object (``s3://bucket/corpus.jsonl.gz``, copied once into the local object
    cache, see docs/object-storage.md) or the name of a bundled corpus (``"shakespeare"``, see
    ``bundled_corpora()``); ``tokenizer_model`` a file or an object's URL too.

    Without ``tokenizer_model`` a byte-fallback SentencePiece BPE model of ``vocab_size`` pieces is trained on
    the corpus; with one, ``vocab_size`` is taken from that model. Documents are shuffled with ``seed``,
    divided by ``split`` (train,validation[,test] weights over documents), each split concatenated with an
    EOD token after every document, and cut into windows of ``seq_length + 1`` tokens with stride
    ``seq_length``. ``prepare_data`` builds the cache (local rank 0); ``setup`` loads it, building it under a
    file lock if it is missing. Tokenization holds the corpus's tokens in memory: meant for corpora of up to
    a few GB of text; larger ones belong in a preprocessed indexed dataset.
    """

    def __init__(
        self,
        path: str,
        seq_length: int = 128,
        micro_batch_size: int = 4,
        global_batch_size: int = 16,
        tokenizer_model: str | None = None,
        vocab_size: int = 4096,
        json_key: str = "text",
        split: str = "98,2",
        seed: int = 1234,
        cache_dir: str | None = None,
        num_workers: int = 0,
        rampup_batch_size: list[int] | None = None,
    ) -> None:
        """Validate paths, corpus, split and sizes now, before any process is spawned; ``rampup_batch_size``
        ramps the training batch up (see :class:`PretrainingDataModule`)."""
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        require_local_or_object_path(path, "path")
        require_local_path(cache_dir, "cache_dir")
        require_local_or_object_path(tokenizer_model, "tokenizer_model")
        # a file, an object (read from a local copy, downloaded once per ETag: the corpus is read several times), or
        # a bundled corpus name ("shakespeare") that works from any cwd
        path = local_input(path) if is_remote(path) else resolve_corpus(path)
        tokenizer_model = None if tokenizer_model is None else local_input(tokenizer_model)
        require("sentencepiece", "TextCorpusDataModule")  # here, before launch, not in every rank's prepare_data
        _check_corpus(path, json_key)
        self.split_fractions = parse_split(split)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.path = os.path.abspath(path)
        self.json_key = json_key
        self.split = split
        self.seed = seed
        self.cache_dir = os.path.abspath(cache_dir) if cache_dir is not None else _default_cache_dir(path)
        self.tokenizer_model = tokenizer_model
        self.tokenizer: SentencePieceTokenizer | None = None
        if tokenizer_model is not None:
            self.tokenizer = SentencePieceTokenizer(tokenizer_model)
            vocab_size = self.tokenizer.vocab_size
        elif isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BYTE_FALLBACK_VOCAB:
            raise ValueError(
                f"vocab_size must be an integer >= {MIN_BYTE_FALLBACK_VOCAB} to train a byte-fallback "
                f"tokenizer, got {vocab_size!r}; use e.g. vocab_size=4096"
            )
        self.vocab_size: int = vocab_size
        # "seed" is left out: Lightning refuses to log hparams when the module saves a different "seed".
        self.save_hyperparameters(ignore=["seed"])
        self.train_dataset: TokenWindowDataset | None = None
        self.val_dataset: TokenWindowDataset | None = None
        self.test_dataset: TokenWindowDataset | None = None
        self._validated_inputs: tuple[object, ...] | None = None  # _corpus_identity() check_before_launch read

    # ---- cache -------------------------------------------------------------------------------------------

    def _corpus_identity(self) -> tuple[object, ...]:
        """What identifies the corpus file's content cheaply."""
        st = os.stat(self.path)
        return (self.path, st.st_size, st.st_mtime_ns, self.json_key)

    def _tokenizer_path(self) -> str:
        """Path of the tokenizer model: the given one, or the cached trained one."""
        if self.tokenizer_model is not None:
            return self.tokenizer_model
        key = _digest(_CACHE_VERSION, *self._corpus_identity(), self.vocab_size)
        return os.path.join(self.cache_dir, f"spm-{key}.model")

    def _token_paths(self, tokenizer_path: str) -> dict[str, str]:
        """Cached token array per split name."""
        key = _digest(
            _CACHE_VERSION, *self._corpus_identity(), self.split_fractions, self.seed, _file_sha256(tokenizer_path)
        )
        return {name: os.path.join(self.cache_dir, f"tokens-{key}-{name}.npy") for name in _SPLIT_NAMES}

    def _build_cache(self) -> dict[str, str]:
        """Train the tokenizer and tokenize the corpus unless cached; load the tokenizer; return array paths."""
        tokenizer_path = self._tokenizer_path()
        if self.tokenizer_model is None and not os.path.isfile(tokenizer_path):
            os.makedirs(self.cache_dir, exist_ok=True)
            with locked(tokenizer_path + ".lock"):
                if not os.path.isfile(tokenizer_path):
                    train_sentencepiece(
                        _iter_documents(self.path, self.json_key), tokenizer_path[: -len(".model")], self.vocab_size
                    )
        if self.tokenizer is None or self.tokenizer.model_path != tokenizer_path:
            self.tokenizer = SentencePieceTokenizer(tokenizer_path)
        self.vocab_size = self.tokenizer.vocab_size
        paths = self._token_paths(tokenizer_path)
        if not all(os.path.isfile(p) for p in paths.values()):
            os.makedirs(self.cache_dir, exist_ok=True)
            with locked(paths["train"] + ".lock"):
                if not all(os.path.isfile(p) for p in paths.values()):
                    self._tokenize_corpus(paths)
        return paths

    def _tokenize_corpus(self, paths: dict[str, str]) -> None:
        """Tokenize every document (+EOD), assign shuffled documents to splits, save one flat array each."""
        assert self.tokenizer is not None
        dtype = np.uint16 if self.vocab_size < 65500 else np.int32
        eod = np.array([self.tokenizer.eod], dtype=dtype)
        docs: list[np.ndarray] = []
        texts = _iter_documents(self.path, self.json_key)
        while chunk := list(itertools.islice(texts, _TOKENIZE_CHUNK)):
            docs.extend(
                np.concatenate([np.asarray(ids, dtype=dtype), eod]) for ids in self.tokenizer.tokenize_batch(chunk)
            )
        order = np.random.default_rng(self.seed).permutation(len(docs))
        bounds = split_boundaries(self.split_fractions, len(docs))
        if bounds[1] == 0:
            raise ValueError(
                f"split {self.split!r} gives the train split 0 of the corpus's {len(docs)} "
                f"documents; raise the train weight of split"
            )
        # each file appears atomically and readers wait for all three, so the order of writes is free
        for i, name in enumerate(_SPLIT_NAMES):
            members = [docs[j] for j in order[bounds[i] : bounds[i + 1]]]
            tokens = np.concatenate(members) if members else np.zeros(0, dtype=dtype)
            write_atomic(paths[name], lambda f, a=tokens: np.save(f, a))

    def _cache_is_built(self) -> bool:
        """Whether the tokenizer and every token array of this corpus version are cached already."""
        tokenizer_path = self._tokenizer_path()
        return os.path.isfile(tokenizer_path) and all(
            os.path.isfile(p) for p in self._token_paths(tokenizer_path).values()
        )

    def check_before_launch(
        self, run: RunSpec, trainer: object = None, module: object = None, datamodule: object = None
    ) -> None:
        """Refuse a corpus with a malformed line (not JSON, not an object, no ``json_key``, not a string),
        naming ``file:line`` and the fix, before any rank starts. The constructor read only up to the first
        text; building the cache reads every line, so the whole file is checked here, once, unless this
        version of the corpus is cached already (then it was read whole before)."""
        identity = self._corpus_identity()
        if self._validated_inputs == identity:
            return
        if not self._cache_is_built():
            for _ in _iter_documents(self.path, self.json_key):
                pass
        self._validated_inputs = identity

    # ---- Lightning hooks ---------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build the tokenizer and token caches (Lightning calls this on local rank 0 only)."""
        self._build_cache()

    def setup(self, stage: str | None = None) -> None:
        """Load the cached token arrays (memory-mapped) and build the split datasets."""
        paths = self._build_cache()
        datasets = [TokenWindowDataset(np.load(paths[name], mmap_mode="r"), self.seq_length) for name in _SPLIT_NAMES]
        self.train_dataset, self.val_dataset, self.test_dataset = datasets

    def _require_setup(self) -> None:
        """Dataloaders need setup(); call it when used outside a Trainer."""
        if self.train_dataset is None:
            self.setup()

    def train_dataloader(self) -> DataLoader:
        """Train batches for this DP rank, continuing from the consumed samples of a resumed run."""
        self._require_setup()
        assert self.train_dataset is not None
        return self._loader(self.train_dataset, "train", self._consumed_at_start())

    def val_dataloader(self) -> DataLoader:
        """Validation batches for this DP rank, always from the start of the validation split."""
        self._require_setup()
        assert self.val_dataset is not None
        return self._loader(self.val_dataset, "validation")

    def test_dataloader(self) -> DataLoader:
        """Test batches for this DP rank (needs a third weight in ``split``, e.g. '969,30,1')."""
        self._require_setup()
        assert self.test_dataset is not None
        return self._loader(self.test_dataset, "test")

    def _too_small_hint(self, split: str) -> str:
        """Name the knobs that grow a split."""
        return (
            f"give the {split} split a larger share of split={self.split!r} (weights are over documents: "
            f"train,validation,test), lower global_batch_size or seq_length, or use a larger corpus"
        )
