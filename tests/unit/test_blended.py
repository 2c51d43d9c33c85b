"""Blending: every prefix tracks the weights within one sample; --data-path parsing; BlendedDataset."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from megatron_lite.data.blended import BlendedDataset, build_blending_indices, normalize_weights, samples_needed
from megatron_lite.data.pretrain import parse_data_path

WEIGHT_SETS = [
    [0.7, 0.3],
    [1.0],
    [0.5, 0.25, 0.25],
    [0.6, 0.1, 0.1, 0.1, 0.1],  # Megatron's largest-deficit greedy drifts to 1.2 here
    [0.9] + [0.1 / 9] * 9,
    [3, 1, 1e-3],  # unnormalised, one tiny weight
    [1 / 3, 1 / 3, 1 / 3],
]


def _assert_every_prefix_within_one(weights: list[float], dataset_index: np.ndarray) -> None:
    """After each prefix of n samples, dataset i has floor(n*w_i) or ceil(n*w_i) of them (exact arithmetic)."""
    exact = [Fraction(w) for w in weights]
    exact = [w / sum(exact) for w in exact]
    counts = np.zeros(len(weights), dtype=np.int64)
    for n, chosen in enumerate(dataset_index, start=1):
        counts[chosen] += 1
        for i, w in enumerate(exact):
            assert abs(counts[i] - n * w) < 1, (weights, n, i, counts[i], float(n * w))


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_every_prefix_is_within_one_sample_of_its_weight(weights: list[float]) -> None:
    size = 2000
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64
    _assert_every_prefix_within_one(weights, dataset_index)
    # each dataset's samples are taken in order 0, 1, 2, ... without gaps
    for i in range(len(weights)):
        assert dataset_sample_index[dataset_index == i].tolist() == list(range(int((dataset_index == i).sum())))
    counts = np.bincount(dataset_index, minlength=len(weights))
    assert all(c <= n for c, n in zip(counts, samples_needed(weights, size)))


def test_random_weights_and_determinism() -> None:
    rng = np.random.default_rng(0)
    for _ in range(60):
        k = int(rng.integers(2, 9))
        weights = rng.dirichlet(np.full(k, float(rng.choice([0.2, 1.0, 5.0])))).tolist()
        _assert_every_prefix_within_one(weights, build_blending_indices(weights, 300)[0])
    a = build_blending_indices([0.7, 0.3], 50)
    assert all(np.array_equal(x, y) for x, y in zip(a, build_blending_indices([7, 3], 50)))
    assert a[0][:10].tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 1]  # worked by hand from the rule


def test_megatrons_greedy_is_not_within_one() -> None:
    """Why the rule differs from Megatron's ``build_blending_indices``: its greedy drifts past one sample."""
    weights, counts, worst = [0.6, 0.1, 0.1, 0.1, 0.1], [0] * 5, 0.0
    for n in range(100):
        errors = [w * max(n, 1) - c for w, c in zip(weights, counts)]
        counts[int(np.argmax(errors))] += 1
        worst = max(worst, max(abs(c - (n + 1) * w) for c, w in zip(counts, weights)))
    assert worst > 1.1


def test_weights_are_checked() -> None:
    assert normalize_weights([3, 1]) == [0.75, 0.25]
    for bad in ([0.5, 0.0], [1.0, -1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match=r"the weight of b\.bin is .*must be a positive number"):
            normalize_weights(bad, ["a.bin", "b.bin"][: len(bad)] if bad[0] > 0 else ["b.bin", "a.bin"])
    with pytest.raises(ValueError, match="no datasets"):
        normalize_weights([])


def test_parse_data_path() -> None:
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_data_path("2 /d/a 1 /d/b") == (["/d/a", "/d/b"], [2.0, 1.0])
    assert parse_data_path(["a"]) == (["a"], [1.0])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(["0.7", "a", "0.3"])
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(["0.7", "a", "b", "0.3"])
    with pytest.raises(ValueError, match=r"the weight of b is 0.0"):
        parse_data_path(["1", "a", "0", "b"])
    with pytest.raises(ValueError, match=r"the weight of a is -1.0"):
        parse_data_path(["-1", "a", "2", "b"])
    with pytest.raises(ValueError, match="no data path"):
        parse_data_path([])


class _Numbers(Dataset):
    """Sample i of dataset d is the tensor [d, i]."""

    def __init__(self, tag: int, size: int) -> None:
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return {"tokens": torch.tensor([self.tag, i])}


def test_blended_dataset_maps_and_caches(tmp_path: Path) -> None:
    datasets = [_Numbers(0, 80), _Numbers(1, 40)]
    blend = BlendedDataset(datasets, [2, 1], 99, descriptions=["a", "b"], cache_dir=str(tmp_path))
    assert len(blend) == 99 and blend.weights == pytest.approx([2 / 3, 1 / 3])
    items = [blend[n]["tokens"].tolist() for n in range(99)]
    assert [i[0] for i in items] == blend.dataset_index.tolist()
    assert [i for i in items if i[0] == 1] == [[1, k] for k in range(33)]
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock")
    assert len(files) == 3 and all(f.startswith(blend.unique_description_hash) for f in files)
    again = BlendedDataset(datasets, [2, 1], 99, descriptions=["a", "b"], cache_dir=str(tmp_path))
    assert isinstance(again.dataset_index, np.memmap) and np.array_equal(again.dataset_index, blend.dataset_index)
    assert (
        BlendedDataset(datasets, [2, 1], 99, descriptions=["a", "c"]).unique_description_hash
        != blend.unique_description_hash
    )
    with pytest.raises(IndexError):
        blend[99]
    with pytest.raises(
        ValueError,
        match=r"dataset 1 has 40 samples but a blend of 150 .* needs 50; build it with "
        r"num_samples >= 50",
    ):
        BlendedDataset([_Numbers(0, 120), datasets[1]], [2, 1], 150)
    with pytest.raises(ValueError, match="the weight of dataset 0 is 0"):
        BlendedDataset(datasets, [0, 1], 10)
    with pytest.raises(ValueError, match="2 weights for 1 datasets"):
        BlendedDataset(datasets[:1], [1, 1], 10)
