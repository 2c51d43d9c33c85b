"""Pretraining on preprocessed ``.bin``/``.idx`` data: Megatron's GPT datasets, blending, split and samplers."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.object_store import filesystem, is_remote
from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator
from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.data.blended import BlendedDataset, normalize_weights, samples_needed
from megatron_lite.data.datamodule import PretrainingDataModule, eval_skip_hint
from megatron_lite.data.gpt_dataset import GPTDataset, local_home
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
from megatron_lite.data.samplers import GlobalBatchSampler, ramp_position
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.local_path import require_local_or_object_path, require_local_path

_SPLIT_NAMES = ("train", "validation", "test")
_SAMPLERS = ("sequential", "cyclic")
# elements per chunk when scanning a .bin for its largest token id: bounds memory on large files
_SCAN_CHUNK = 1 << 24


def parse_data_path(data_path: Sequence[str] | str) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``["0.7", "a", "0.3", "b"]`` -> (["a", "b"], [0.7, 0.3]).

    A single path gets weight ``[1.0]``; several paths without weights give ``None`` (weighted by size, as
    Megatron blends unweighted paths). A string is split on whitespace. Weights are returned as given (not
    normalised) after checking each is a positive number.
    """
    items = data_path.split() if isinstance(data_path, str) else [os.fspath(p) for p in data_path]
    if not items:
        raise ValueError("no data path given; pass paths=['<prefix>'] or ['0.7', '<prefix a>', '0.3', '<prefix b>']")
    if len(items) == 1:
        return items, [1.0]

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    weights = [number(w) for w in items[0::2]]
    if all(w is None for w in weights) and all(number(p) is None for p in items[1::2]):
        return items, None  # paths only
    if len(items) % 2 or any(w is None for w in weights) or any(number(p) is not None for p in items[1::2]):
        raise ValueError(
            f"data path {items!r} is neither a list of prefixes nor weight/prefix pairs; use e.g. "
            f"['0.7', '/data/a_text_document', '0.3', '/data/b_text_document']"
        )
    prefixes = items[1::2]
    normalize_weights([float(w) for w in weights], prefixes)  # type: ignore[arg-type]  # raises naming a bad one
    return prefixes, [float(w) for w in weights]  # type: ignore[arg-type]


def _check_prefix(path: str) -> str:
    """The absolute prefix of an existing ``.bin``/``.idx`` pair (a ``.bin``/``.idx`` suffix is dropped)."""
    require_local_or_object_path(path, "data path")
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    prefix = prefix if is_remote(prefix) else os.path.abspath(prefix)
    present = filesystem(prefix).isfile if is_remote(prefix) else os.path.isfile
    for suffix in (".idx", ".bin"):
        if not present(prefix + suffix):
            raise FileNotFoundError(
                f"{prefix + suffix} does not exist: data paths are prefixes of .bin/.idx pairs; create them with "
                f"`megatron-lite preprocess --output-prefix {prefix} ...` or fix the path"
            )
    return prefix


def _max_token_id(prefix: str, dtype: Any) -> int:
    """Largest token id in ``{prefix}.bin`` (-1 if empty), scanned in chunks."""
    if is_remote(prefix):
        raise ValueError(
            f"the vocabulary size of {prefix} would be found by reading its whole .bin from the object store; pass "
            f"vocab_size= (or a tokenizer) instead"
        )
    size = os.path.getsize(prefix + ".bin") // np.dtype(dtype).itemsize
    if size == 0:
        return -1
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(size,))
    return int(max(tokens[i : i + _SCAN_CHUNK].max() for i in range(0, size, _SCAN_CHUNK)))


class PretrainDataModule(PretrainingDataModule):
    """GPT pretraining batches from Megatron indexed datasets, blended by weight, split by documents.

    ``paths`` is Megatron's ``--data-path``: one prefix, or ``weight prefix`` pairs (``["0.7", "a", "0.3",
    "b"]``); prefixes without weights are weighted by their token counts. Each file's documents are divided by
    ``split`` (train,validation,test weights, Megatron's rounding) and each split becomes a :class:`GPTDataset`
    (several files: a :class:`BlendedDataset`). The train split holds ``train_samples`` samples (default:
    ``trainer.max_steps * global_batch_size`` when a trainer with ``max_steps`` is attached, else one epoch);
    validation and test hold ``eval_samples`` (default one epoch). Resuming needs the same ``train_samples``
    (or ``max_steps``): the sample order depends on it, as in Megatron.

    ``vocab_size`` (what the CLI links into the model) is the tokenizer's if one is given, else the explicit
    ``vocab_size``, else the largest token id in the data + 1, found by scanning every ``.bin`` once here (pass
    ``vocab_size`` to skip the scan on large data). ``sampler="sequential"`` is Megatron's pretraining sampler
    (exact resume at any data-parallel size); ``"cyclic"`` is its random sampler (a new permutation per epoch;
    with ``data_sharding`` its order depends on the DP size). Evaluation always uses the sequential order.
    ``eod_mask_loss`` (needs a tokenizer) adds a ``loss_mask`` that drops the loss after each EOD input token.
    ``reset_position_ids`` (needs a tokenizer) adds ``position_ids`` that restart at 0 after each EOD input
    token, and ``reset_attention_mask`` (needs a tokenizer) adds ``cu_seqlens`` (each document's start in the
    row, then ``seq_length + 1``, then -1 padding to ``seq_length + 2`` entries) so that attention never
    crosses a document boundary: Megatron's ``--reset-position-ids`` / ``--reset-attention-mask``, the EOD
    ending its document (see :class:`GPTDataset`). The three are independent; together they train each
    document of a row as if it were alone.
    ``rampup_batch_size`` ramps the training batch up (see :class:`PretrainingDataModule`).
    """

    def __init__(
        self,
        paths: Sequence[str] | str,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        split: str = "969,30,1",
        seed: int = 1234,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        cache_dir: str | None = None,
        num_workers: int = 0,
        sampler: str = "sequential",
        train_samples: int | None = None,
        eval_samples: int | None = None,
        data_sharding: bool = True,
        eod_mask_loss: bool = False,
        rampup_batch_size: list[int] | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
    ) -> None:
        """Validate paths, weights, split and sizes now, before any process is spawned."""
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        raw_prefixes, weights = parse_data_path(paths)
        self.prefixes = [_check_prefix(p) for p in raw_prefixes]
        """Absolute ``.bin``/``.idx`` prefixes, one per dataset."""
        self.split = split
        self.split_fractions = parse_split(split)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if sampler not in _SAMPLERS:
            raise ValueError(f"sampler must be one of {_SAMPLERS}, got {sampler!r}")
        for name, value in (("train_samples", train_samples), ("eval_samples", eval_samples)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < global_batch_size
            ):
                raise ValueError(
                    f"{name} must be None or an integer >= global_batch_size ({global_batch_size}), got {value!r}"
                )
        for name, value in (
            ("eod_mask_loss", eod_mask_loss),
            ("reset_position_ids", reset_position_ids),
            ("reset_attention_mask", reset_attention_mask),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
            if value and tokenizer is None:
                raise ValueError(f"{name}=True needs the tokenizer (for its EOD id); pass tokenizer=...")
        self.seed = seed
        self.sampler = sampler
        self.data_sharding = data_sharding
        self.train_samples = train_samples
        self.eval_samples = eval_samples
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.cache_dir = os.path.abspath(require_local_path(cache_dir, "cache_dir")) if cache_dir is not None else None
        self.tokenizer = tokenizer

        tokens, max_ids = [], []
        for prefix in self.prefixes:
            data = IndexedDataset(prefix)
            bounds = split_boundaries(self.split_fractions, len(data))
            if bounds[1] == 0:
                raise ValueError(
                    f"split {split!r} leaves the train split of {prefix} with 0 of its {len(data)} documents; "
                    f"raise the train weight of split (e.g. split='98,2') or use a file with more documents"
                )
            tokens.append(int(np.asarray(data.sequence_lengths).sum(dtype=np.int64)))
            if tokenizer is None and vocab_size is None:
                max_ids.append(_max_token_id(prefix, data.dtype))
            del data  # not kept: memory maps do not survive pickling into spawned processes
        self.weights = normalize_weights(weights if weights is not None else tokens, self.prefixes)
        """Normalised blend weights, one per prefix."""
        self.vocab_size: int = self._resolve_vocab_size(tokenizer, vocab_size, max_ids)
        # "seed" is left out: Lightning refuses to log hparams when the module saves a different "seed";
        # the tokenizer is an object the checkpoint should not pickle
        self.save_hyperparameters(ignore=["seed", "tokenizer"])
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._restored_layout: dict[str, Any] = {}

    def _resolve_vocab_size(self, tokenizer: Any, vocab_size: int | None, max_ids: list[int]) -> int:
        """Tokenizer's vocabulary, else the explicit one, else max token id + 1 (see the class docstring)."""
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
        ):
            raise ValueError(f"vocab_size must be None or a positive integer, got {vocab_size!r}")
        if tokenizer is not None:
            size = getattr(tokenizer, "vocab_size", None)
            if not isinstance(size, int):
                raise TypeError(
                    f"tokenizer must be a megatron_lite Tokenizer (with an int vocab_size), got "
                    f"{type(tokenizer).__name__}"
                )
            if vocab_size is not None and vocab_size != size:
                raise ValueError(
                    f"vocab_size={vocab_size} contradicts the tokenizer's vocabulary of {size}; "
                    f"drop vocab_size (it is taken from the tokenizer)"
                )
            return size
        if vocab_size is not None:
            return vocab_size
        largest = max(max_ids)
        if largest < 0:
            raise ValueError(
                f"{self.prefixes} hold no tokens; preprocess a corpus with text (megatron-lite preprocess)"
            )
        return largest + 1

    # ---- datasets ----------------------------------------------------------------------------------------

    def _target_samples(self, split: str) -> int | None:
        """Samples the split must hold: asked for, else from the trainer's max_steps (train), else one epoch."""
        if split != "train":
            return self.eval_samples
        if self.train_samples is not None:
            return self.train_samples
        max_steps = getattr(self.trainer, "max_steps", None) if self.trainer is not None else None
        if isinstance(max_steps, int) and max_steps > 0:
            return max_steps * self.global_batch_size
        return None

    def _build(self, split: str) -> Dataset:
        """The dataset of ``split``: one GPTDataset, or a blend of one per prefix."""
        which = _SPLIT_NAMES.index(split)
        target = self._target_samples(split)
        per_file = []
        for prefix in self.prefixes:
            data = IndexedDataset(prefix)
            bounds = split_boundaries(self.split_fractions, len(data))
            if bounds[which + 1] <= bounds[which]:
                raise ValueError(
                    f"the {split} split of {prefix} is empty ({len(data)} documents, split={self.split!r}); "
                    f"{self._too_small_hint(split)}{eval_skip_hint(split)}"
                )
            per_file.append((prefix, data, np.arange(bounds[which], bounds[which + 1], dtype=np.int64)))
        eod = self.tokenizer.eod if self.tokenizer is not None else None

        def gpt(prefix: str, data: IndexedDataset, docs: np.ndarray, num_samples: int | None) -> GPTDataset:
            return GPTDataset(
                data,
                prefix,
                docs,
                num_samples,
                self.seq_length,
                self.seed,
                split,
                cache_dir=self.cache_dir,
                eod_mask_token=eod if self.eod_mask_loss else None,
                reset_position_ids=self.reset_position_ids,
                reset_attention_mask=self.reset_attention_mask,
                eod_token=eod,
            )

        if len(per_file) == 1:
            return gpt(*per_file[0], target)
        if target is None:
            datasets = [gpt(*item, None) for item in per_file]
            # the largest blend that needs no dataset beyond one epoch
            target = min(math.floor(len(d) / w) for d, w in zip(datasets, self.weights))
            while any(n > len(d) for n, d in zip(samples_needed(self.weights, target), datasets)):
                target -= 1  # only float rounding of len / w can get here
        else:
            datasets = [gpt(*item, max(1, n)) for item, n in zip(per_file, samples_needed(self.weights, target))]
        blend_cache = self.cache_dir or os.path.join(local_home(self.prefixes[0]), "cache", "BlendedDataset_indices")
        return BlendedDataset(
            datasets,
            self.weights,
            target,
            descriptions=[d.unique_description_hash for d in datasets],
            cache_dir=blend_cache,
        )

    def prepare_data(self) -> None:
        """Nothing: ``setup`` builds the index caches on global rank 0 while the other ranks wait."""

    def setup(self, stage: str | None = None) -> None:
        """Build (or load) the train indices for fitting; evaluation splits are built when their loader is asked.

        Building waits for global rank 0 at a barrier, so every rank must call this (Lightning does). Evaluation
        splits are left to their loaders so that a run that skips them (``limit_val_batches=0``) never fails
        on an empty one.
        """
        if stage in (None, "fit"):
            self._dataset("train")
        elif stage in ("validate", "test"):
            self._dataset("validation" if stage == "validate" else "test")

    def _dataset(self, split: str) -> Dataset:
        """The built dataset of ``split`` (building it when used outside a Trainer)."""
        attribute = {"train": "train_dataset", "validation": "val_dataset", "test": "test_dataset"}[split]
        if getattr(self, attribute) is None:
            dataset = self._build(split)
            if self.reset_attention_mask:  # bad packing fails here, before the first step, not inside attention
                check_cu_seqlens(
                    dataset[0]["cu_seqlens"], self.seq_length + 1, f"the first {split} sample's cu_seqlens"
                )
            setattr(self, attribute, dataset)
        return getattr(self, attribute)

    # ---- loaders -----------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        """Train batches for this DP rank, continuing from the consumed samples of a resumed run."""
        dataset = self._dataset("train")
        consumed = self._consumed_at_start()
        self._warn_on_layout_change(consumed, len(dataset))  # type: ignore[arg-type]
        self._restored_layout = {}
        return self._loader(dataset, "train", consumed)

    def _warn_on_layout_change(self, consumed: int, total_samples: int) -> None:
        """Warn when the restored state was reached with a sampler or DP layout that this run cannot continue."""
        restored = self._restored_layout
        old_dp, dp_size = restored.get("data_parallel_size"), self._dp_size_and_rank()[0]
        usable = total_samples - total_samples % self.global_batch_size
        if self.rampup_batch_size is None:
            mid_epoch = usable > 0 and consumed % usable != 0
        else:  # under a ramp-up passes do not end at multiples of usable: walk the schedule
            mid_epoch = ramp_position(consumed, usable, self.geometry.num_microbatches_calculator(1))[2] != 0
        if restored.get("sampler") not in (None, self.sampler):
            warnings.warn(
                f"the checkpoint was trained with sampler={restored['sampler']!r}, this run uses "
                f"{self.sampler!r}: the resumed order does not continue the old one",
                stacklevel=3,
            )
        elif (
            self.sampler == "cyclic"
            and self.data_sharding
            and restored.get("data_sharding")
            and mid_epoch
            and old_dp not in (None, dp_size)
        ):
            warnings.warn(
                f"resuming the cyclic sampler with data_sharding at data-parallel size {dp_size} after {old_dp}, "
                f"mid-epoch: each rank's shard depends on that size, so until this epoch ends some samples repeat "
                f"and others are skipped. Resume at the old size, or use sampler='sequential' or "
                f"data_sharding=False, whose order does not depend on it.",
                stacklevel=3,
            )

    def val_dataloader(self) -> DataLoader:
        """Validation batches for this DP rank, always from the start of the validation split."""
        return self._loader(self._dataset("validation"), "validation")

    def test_dataloader(self) -> DataLoader:
        """Test batches for this DP rank (needs a test weight in ``split``, e.g. '969,30,1')."""
        return self._loader(self._dataset("test"), "test")

    def _make_sampler(
        self,
        total_samples: int,
        consumed_samples: int,
        dp_size: int,
        rank: int,
        split: str,
        calculator: NumMicroBatchesCalculator | None = None,
    ) -> GlobalBatchSampler:
        """The base class's sequential sampler, or the cyclic random sampler for training."""
        if split != "train" or self.sampler == "sequential":
            return super()._make_sampler(total_samples, consumed_samples, dp_size, rank, split, calculator)
        return MegatronPretrainingRandomSampler(
            total_samples=total_samples,
            consumed_samples=consumed_samples,
            global_batch_size=self.global_batch_size,
            num_replicas=dp_size,
            rank=rank,
            seed=self.seed,
            data_sharding=self.data_sharding,
            calculator=calculator,
        )

    def _too_small_hint(self, split: str) -> str:
        """Name the knobs that grow a split."""
        return (
            f"give the {split} split a larger share of split={self.split!r} (weights over documents: "
            f"train,validation,test), lower global_batch_size or seq_length, or add data to {self.prefixes}"
        )

    # ---- checkpoint state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Consumed samples, plus the sampler and DP size they were reached with (to flag a layout change)."""
        state = super().state_dict()
        if self.trainer is not None:
            state.update(
                sampler=self.sampler, data_sharding=self.data_sharding, data_parallel_size=self._dp_size_and_rank()[0]
            )
        elif state:
            state.update(self._restored_layout)  # restored but not yet used: hand it on unchanged
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``consumed_samples``; keep the saved layout to check against the resumed one."""
        super().load_state_dict(state_dict)
        self._restored_layout = {
            k: state_dict[k] for k in ("sampler", "data_sharding", "data_parallel_size") if k in state_dict
        }
