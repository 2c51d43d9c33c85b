"""Megatron's GPT dataset: samples of ``seq_length + 1`` tokens cut across documents of an indexed dataset.

Three index arrays, built as Megatron-LM's ``megatron/core/datasets/gpt_dataset.py`` builds them (numpy here,
not its C++ helper) and cached beside the data:

* document index: the split's documents repeated for as many epochs as the requested samples need, shuffled
  with ``np.random.RandomState(seed)`` (the whole array at once; with Megatron's ``separate_final_epoch``
  rule a final epoch that contributes under 80% of an epoch's samples is shuffled on its own);
* sample index: ``[num_samples + 1, 2]`` (position in the document index, token offset) of each sample's
  first token. Sample ``i`` starts at token ``i * seq_length`` of the concatenated document stream and holds
  ``seq_length + 1`` tokens, so neighbours share one token (``add_extra_token_to_sequence=True``);
* shuffle index: a permutation of the samples, drawn from the same random state.

For the same inputs the three arrays equal Megatron's. "Documents" are the indexed dataset's sequences, as in
Megatron's GPT dataset (one sequence per document unless the data was preprocessed with sentence splitting).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_lite.core.object_staging import object_cache_dir, url_digest
from megatron_lite.core.object_store import is_remote
from megatron_lite.core.parallel.packing import cu_seqlens_from_eod, position_ids_from_cu_seqlens
from megatron_lite.data._index_cache import array_digest, describe, load_or_build
from megatron_lite.utils.local_path import require_local_or_object_path, require_local_path

if TYPE_CHECKING:
    from megatron_lite.data.indexed_dataset import IndexedDataset

# Megatron's threshold: a final epoch that adds fewer than this fraction of an epoch's samples is shuffled
# separately, so its few documents are not spread thinly over the whole run
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_for(num_tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs needed for ``num_samples`` samples (each needs ``seq_length`` new tokens, plus one at the end)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + 1
    return max(1, -(-requested // num_tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled (the final epoch apart if asked), int32."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """``[num_samples + 1, 2]`` int64: (document-index position, offset) of token ``i * seq_length`` for each i.

    Equal to Megatron's ``build_sample_idx`` (a token walk) with ``drop_last_partial_sequence`` and the
    extra token: entry ``i + 1`` is where sample ``i + 1`` starts, i.e. one token before sample ``i`` ends.
    Empty documents are skipped the way the walk skips them (no start but the first lands on one).
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)))
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" puts a position that is a document's first token in that document, past empty ones
    doc = np.searchsorted(starts, positions, side="right") - 1
    doc[0] = 0  # except the first sample: the walk starts at (0, 0) even if leading documents are empty
    return np.stack((doc, positions - starts[doc]), axis=1)


def build_shuffle_index(num_samples: int, num_shuffled_first: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``range(num_samples)``: ``[0, first)`` and ``[first, num_samples)`` shuffled apart."""
    dtype = np.uint32 if num_samples < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_shuffled_first, dtype=dtype)
    rng.shuffle(first)
    if num_shuffled_first == num_samples:
        return first
    last = np.arange(num_shuffled_first, num_samples, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """The document, sample and shuffle index of one split (see the module docstring)."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_final_epoch = False
    if num_epochs > 1 and num_samples is not None:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - samples_before_final
        separate_final_epoch = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total_samples)
    first = samples_before_final if separate_final_epoch else total_samples
    shuffle_index = build_shuffle_index(total_samples, first, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def local_home(path_prefix: str) -> str:
    """Where a dataset's local caches go by default: beside a local prefix, under :func:`object_cache_dir` for a
    URL."""
    return os.path.join(object_cache_dir(), url_digest(path_prefix)) if is_remote(path_prefix) else path_prefix


class GPTDataset(Dataset):
    """Sample ``i`` is ``{"tokens": LongTensor[seq_length + 1]}`` from the split ``indexed_indices``.

    ``num_samples=None`` builds one epoch; otherwise enough whole epochs for ``num_samples`` (``len`` can be
    larger: every sample of those epochs is kept, as in Megatron). Megatron's per-document options, all keyed
    on the EOD id (``eod_token``, default ``eod_mask_token``); as in Megatron's
    ``_get_ltor_masks_and_position_ids`` an EOD *input* token is the last token of its document and the next
    token starts a new one:

    * ``eod_mask_token`` (``eod_mask_loss``): a ``"loss_mask"`` (float ``[seq_length]``) that is 0 where the
      input token is that id, i.e. the first token of the next document is not trained;
    * ``reset_position_ids``: ``"position_ids"`` (long ``[seq_length]``) restarting at 0 after each EOD input;
    * ``reset_attention_mask``: ``"cu_seqlens"`` (int32 ``[seq_length + 2]``, the packed-row format of
      :mod:`megatron_lite.core.parallel.packing`) so that attention never crosses a document boundary.

    The index arrays are cached in ``cache_dir`` (default: ``{dataset_path_prefix}/cache/GPTDataset_indices``,
    Megatron's place), under a hash of everything that determines them.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path_prefix: str,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split: str = "train",
        cache_dir: str | None = None,
        eod_mask_token: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_token: int | None = None,
    ) -> None:
        """Build (or load) the index arrays; errors name the data file and what to change."""
        for name, value, minimum in (("seq_length", seq_length, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if eod_token is not None and eod_mask_token is not None and eod_token != eod_mask_token:
            raise ValueError(
                f"eod_token={eod_token} and eod_mask_token={eod_mask_token} name different EOD ids; "
                f"documents end with one EOD: pass the same id (or only one of them)"
            )
        eod_token = eod_token if eod_token is not None else eod_mask_token
        if (reset_position_ids or reset_attention_mask) and eod_token is None:
            raise ValueError(
                "reset_position_ids / reset_attention_mask find documents by their EOD token; pass "
                "eod_token=tokenizer.eod"
            )
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1
        ):
            raise ValueError(f"num_samples must be None (one epoch) or an integer >= 1, got {num_samples!r}")
        self.dataset = indexed_dataset
        require_local_or_object_path(dataset_path_prefix, "dataset_path_prefix")
        self.path_prefix = (
            dataset_path_prefix if is_remote(dataset_path_prefix) else os.path.abspath(dataset_path_prefix)
        )
        require_local_path(cache_dir, "cache_dir")
        self.indices = np.asarray(indexed_indices, dtype=np.int64)
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.eod_mask_token = eod_mask_token
        self.eod_token = eod_token
        """The EOD id that ends a document (for the ``reset_*`` options)."""
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        # Every input token can be an EOD (documents of a lone EOD are common with `preprocess --append-eod`),
        # so a row holds up to seq_length + 1 document starts (0, then one after each of the seq_length
        # inputs) plus its end: seq_length + 2 entries is the smallest fixed length no row can overflow.
        self.cu_seqlens_length = seq_length + 2
        """Entries of every sample's ``cu_seqlens`` (with ``reset_attention_mask``)."""
        lengths = indexed_dataset.sequence_lengths
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= len(lengths)):
            raise IndexError(f"{split} split of {self.path_prefix}: document ids must lie in [0, {len(lengths)})")
        tokens = int(lengths[self.indices].sum(dtype=np.int64)) if len(self.indices) else 0
        if tokens < seq_length + 1:
            raise ValueError(
                f"the {split} split of {self.path_prefix} holds {len(self.indices)} documents with {tokens} tokens, "
                f"fewer than one sample of seq_length + 1 = {seq_length + 1}; give the {split} split a larger "
                f"share of the data split, lower seq_length, or add data (megatron-lite preprocess)"
            )
        self.num_tokens_per_epoch = tokens
        """Tokens in one pass over the split's documents."""
        self.num_samples = num_samples
        """Samples asked for (None: one epoch); ``len(self)`` is at least this."""
        # The reset_* options and the EOD loss mask are left out of the key on purpose: they are computed from a
        # sample's tokens in __getitem__ and change none of the cached arrays, so every setting shares one cache.
        self.description, self.unique_description_hash = describe(
            {
                "class": type(self).__name__,
                "dataset_path_prefix": self.path_prefix,
                "split": split,
                "indices_md5": array_digest(self.indices),
                "num_documents": len(self.indices),
                "num_sequences_in_file": len(lengths),
                "num_tokens_per_epoch": tokens,
                "num_samples": num_samples,
                "seq_length": seq_length,
                "seed": seed,
                "add_extra_token_to_sequence": True,
            }
        )
        self.cache_dir = cache_dir or os.path.join(
            local_home(self.path_prefix), "cache", f"{type(self).__name__}_indices"
        )
        arrays = load_or_build(
            self.cache_dir,
            f"{type(self).__name__}-{split}",
            self.description,
            self.unique_description_hash,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_gpt_indices(lengths, self.indices, num_samples, seq_length, seed),
        )
        self.document_index: np.ndarray = arrays["document_index"]
        self.sample_index: np.ndarray = arrays["sample_index"]
        self.shuffle_index: np.ndarray = arrays["shuffle_index"]

    def __len__(self) -> int:
        """Samples available (whole epochs, so possibly more than ``num_samples``)."""
        return int(self.sample_index.shape[0]) - 1

    def reads(self, index: int) -> list[tuple[int, int, int]]:
        """The ``(sequence, offset, length)`` reads of the indexed dataset that make sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples of {self.path_prefix}")
        j = int(self.shuffle_index[index])
        first_doc, first_offset = (int(x) for x in self.sample_index[j])
        last_doc, last_offset = (int(x) for x in self.sample_index[j + 1])
        if first_doc == last_doc:
            return [(int(self.document_index[first_doc]), first_offset, last_offset - first_offset + 1)]
        lengths = self.dataset.sequence_lengths
        first = int(self.document_index[first_doc])
        reads = [(first, first_offset, int(lengths[first]) - first_offset)]
        for d in range(first_doc + 1, last_doc):
            sequence = int(self.document_index[d])
            reads.append((sequence, 0, int(lengths[sequence])))
        reads.append((int(self.document_index[last_doc]), 0, last_offset + 1))
        return reads

    def prefetch_samples(self, indices: Sequence[int]) -> None:
        """Start the reads of samples ``indices`` in the background (a ``.bin`` in an object store; nothing for a
        local one). A loader's sampler calls it with this rank's next batch (:mod:`~megatron_lite.data.read_ahead`),
        so that batch arrives while the step computes."""
        if self.dataset.remote is not None:
            self.dataset.prefetch(read for i in indices for read in self.reads(int(i)))

    def tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` (after the shuffle) as an int64 array."""
        parts = [
            self.dataset.get(sequence, offset=offset, length=length) for sequence, offset, length in self.reads(index)
        ]
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"tokens": LongTensor[seq_length + 1]}``, plus ``"loss_mask"`` with ``eod_mask_token``,
        ``"position_ids"`` with ``reset_position_ids`` and ``"cu_seqlens"`` with ``reset_attention_mask``."""
        tokens = torch.from_numpy(self.tokens(index))
        sample = {"tokens": tokens}
        if self.eod_mask_token is not None:
            sample["loss_mask"] = (tokens[:-1] != self.eod_mask_token).float()
        if self.reset_position_ids or self.reset_attention_mask:
            cu_seqlens = cu_seqlens_from_eod(tokens, self.eod_token, self.cu_seqlens_length)  # type: ignore[arg-type]
            if self.reset_position_ids:
                sample["position_ids"] = position_ids_from_cu_seqlens(cu_seqlens, self.seq_length)
            if self.reset_attention_mask:
                sample["cu_seqlens"] = cu_seqlens
        return sample
