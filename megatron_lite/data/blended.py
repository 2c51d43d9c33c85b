"""Blending several datasets by weight, deterministically, so that every prefix tracks the weights."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from megatron_lite.data._index_cache import describe, load_or_build
from megatron_lite.data.read_ahead import prefetch_samples

# largest denominator when reading a float weight as the fraction it stands for (see _exact_weights)
_MAX_DENOMINATOR = 10**12


def normalize_weights(weights: Sequence[float], names: Sequence[str] | None = None) -> list[float]:
    """Weights divided by their sum; a weight <= 0 (or not a finite number) raises ValueError naming it."""
    names = list(names) if names is not None else [f"dataset {i}" for i in range(len(weights))]
    if len(weights) == 0:
        raise ValueError("no datasets to blend; pass at least one data path")
    if len(names) != len(weights):
        raise ValueError(f"{len(weights)} weights for {len(names)} datasets; give one weight per dataset")
    for name, weight in zip(names, weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"the weight of {name} is {weight!r}; every weight must be a positive number (drop "
                f"the dataset instead of giving it weight 0)"
            )
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def _exact_weights(weights: Sequence[float]) -> tuple[list[int], int]:
    """Integer numerators ``W`` and a denominator ``D``: ``W[i] / D`` is weight ``i`` as the fraction meant.

    Each normalised float is read as the nearest fraction with a denominator up to 10**12 (0.1 -> 1/10, 2/3 of
    ``[2, 1]`` -> 2/3), so that float rounding cannot move a quota boundary; these differ from the floats by far
    less than one sample over any feasible number of samples.
    """
    fractions = [Fraction(w).limit_denominator(_MAX_DENOMINATOR) for w in normalize_weights(weights)]
    total = sum(fractions)
    exact = [f / total for f in fractions]
    denominator = 1
    for f in exact:
        denominator = math.lcm(denominator, f.denominator)
    return [int(f * denominator) for f in exact], denominator


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) for ``size`` samples blended by ``weights``.

    Sample ``n`` goes to the dataset that is furthest behind, among those that may take one more sample
    without exceeding their upper quota ``ceil((n + 1) * w)``, measured by ``w / (count + 1)`` (Balinski and
    Young's quota method; ties go to the lower index). Unlike Megatron's largest-deficit greedy, which can drift
    more than one sample from ``n * w`` with four or more datasets (e.g. weights 0.6, 0.1, 0.1, 0.1, 0.1),
    this keeps every count in ``{floor(n * w), ceil(n * w)}`` after every prefix of ``n`` samples. The
    arithmetic is exact (integers), so ties and boundaries do not depend on float rounding.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be an integer >= 0, got {size!r}")
    numerators, denominator = _exact_weights(weights)
    k = len(numerators)
    counts = [0] * k
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for n in range(size):
        quota_numerator = n + 1  # eligible: counts[i] < W[i] * (n + 1) / D, i.e. one more stays within quota
        best = -1
        for i in range(k):
            c = counts[i]
            if c * denominator < numerators[i] * quota_numerator and (
                best < 0 or numerators[i] * (counts[best] + 1) > numerators[best] * (c + 1)
            ):
                best = i
        dataset_index[n] = best
        dataset_sample_index[n] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def samples_needed(weights: Sequence[float], size: int) -> list[int]:
    """Upper bound on the samples each dataset gives to a blend of ``size``: ``ceil(size * w)`` (quota)."""
    numerators, denominator = _exact_weights(weights)
    return [-(-size * w // denominator) for w in numerators]


class BlendedDataset(Dataset):
    """Sample ``n`` is ``datasets[dataset_index[n]][dataset_sample_index[n]]``; see :func:`build_blending_indices`.

    The two index arrays are cached in ``cache_dir`` (if given) under a hash of the weights, the size and
    ``descriptions`` (one string per dataset that identifies it, e.g. its cache description hash).
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        size: int,
        descriptions: Sequence[str] | None = None,
        cache_dir: str | None = None,
    ) -> None:
        """Normalise the weights, build (or load) the indices, and check every dataset is large enough."""
        names = [str(getattr(d, "path_prefix", f"dataset {i}")) for i, d in enumerate(datasets)]
        if len(datasets) != len(weights):
            raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets; give one weight per dataset")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an integer >= 1, got {size!r}")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended, got {len(datasets)}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, names)
        self.size = size
        sizes = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        if descriptions is None:
            # without descriptions a dataset is known only by its type and size: pass them to share a cache
            descriptions = [
                str(getattr(d, "unique_description_hash", f"{type(d).__name__}:{n}"))
                for d, n in zip(self.datasets, sizes)
            ]
        self.description, self.unique_description_hash = describe(
            {"class": type(self).__name__, "datasets": list(descriptions), "weights": self.weights, "size": size}
        )

        def build() -> dict[str, np.ndarray]:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, size)
            return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

        if cache_dir is None:
            arrays = build()
        else:
            arrays = load_or_build(
                os.fspath(cache_dir),
                type(self).__name__,
                self.description,
                self.unique_description_hash,
                ("dataset_index", "dataset_sample_index"),
                build,
            )
        self.dataset_index: np.ndarray = arrays["dataset_index"]
        self.dataset_sample_index: np.ndarray = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for name, available, weight, needed in zip(names, sizes, self.weights, counts):
            if needed > available:
                raise ValueError(
                    f"{name} has {available} samples but a blend of {size} at weight {weight:.4g} needs "
                    f"{needed}; build it with num_samples >= {needed} (see samples_needed())"
                )

    def __len__(self) -> int:
        """Samples in the blend."""
        return self.size

    def __getitem__(self, index: int) -> Any:
        """The sample of the dataset chosen for position ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample index {index} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]

    def prefetch_samples(self, indices: Sequence[int]) -> None:
        """Start reading the blend's samples ``indices`` ahead: each dataset is handed its own samples of them."""
        chosen = np.asarray(indices, dtype=np.int64)
        owner = self.dataset_index[chosen]
        for which, dataset in enumerate(self.datasets):
            prefetch_samples(dataset, self.dataset_sample_index[chosen[owner == which]].tolist())
